"""`make demo`: GRPO with Megatron-Core workers through the host trainer, on CPU, end to end.

See :mod:`skyrl_megatron.demo.__main__` for what runs; :mod:`.task` is the environment and data,
:mod:`.experiment` the host experiment with its checks and console reporting.
"""
