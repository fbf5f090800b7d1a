"""Expert activation statistics: which routed experts calibration tokens reach, per layer, and what SGLang-KT
makes of them.

* ``routing.py``: the model's own routed choice, counted at each MoE block's experts module.
* ``stats.py``: ``ktconvert expert-stats`` (the float layer stream of ktconvert.gptq.stream, counting on the way).
* ``counts.py``: the ``expert_activation.pt`` file SGLang-KT reads (--init-expert-location), written and loaded.
* ``placement.py``: SGLang-KT's GPU expert selection (frequency / uniform) and its VRAM (``plan --gpu-experts``).
* ``report.py``: the HTML picture (``--report``).

torch / transformers are imported inside functions (the ``[gpu]`` extra).
"""
