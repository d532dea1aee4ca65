"""Subprocesses started with this folder on PYTHONPATH (``loongforge train`` in the tests) see the CPU stand-in of
``torch_xmlir`` placed on the CPU (see ``cpu_placement.py``)."""

import cpu_placement

cpu_placement.install()
