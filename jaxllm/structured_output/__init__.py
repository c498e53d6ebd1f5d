"""Structured outputs (constrained decoding) with llguidance: the grammar of a request's
constraint (`grammar.py`), its matcher in the engine core (`request.py`), and the core's
manager of compilations and per-step masks (`manager.py`)."""
