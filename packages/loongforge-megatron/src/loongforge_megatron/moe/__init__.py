"""Mixture-of-experts tools of the megatron backend: dynamic replica planning (``placement``), routing traces
(``trace``) and the replay simulator that compares planners on them (``simulate``)."""
