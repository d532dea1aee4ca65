"""``loongforge.worker`` that stops inside the save of step ``HOLD_SAVE_STEP``: after writing its rank file into
the staging directory it writes its pid to ``HOLD_FLAG.<rank>`` and sleeps, so a test can SIGKILL the run mid-save.
(torchrun starts each worker in its own session, so the test kills the workers by pid and the launcher by
process group.)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

_save = torch.save


def _holding_save(obj, f, *args, **kwargs):
    _save(obj, f, *args, **kwargs)
    step = int(os.environ["HOLD_SAVE_STEP"])
    if ".tmp-" in str(f) and f"step_{step:08d}" in str(f):
        flag = Path(f"{os.environ['HOLD_FLAG']}.{os.environ['RANK']}")
        tmp = flag.with_name(f"{flag.name}.tmp")  # per rank: with_suffix would give both ranks one name
        tmp.write_text(str(os.getpid()))
        tmp.rename(flag)
        time.sleep(600)  # the test kills the process tree here


if __name__ == "__main__":
    torch.save = _holding_save
    from loongforge.worker import main

    sys.exit(main())
