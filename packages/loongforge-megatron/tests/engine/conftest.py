"""Engine tests use the ``ranks`` fixture from ``tests/conftest.py`` (forked gloo ranks with a watchdog)."""
