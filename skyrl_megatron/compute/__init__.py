"""What a rank runs on a built model, free of Ray and of the host's worker classes: `runner.ModelRunner`
prepares the rank's rows as micro-batches (`microbatch/`), runs them through Megatron's pipeline
schedules (`schedule.py`) with the chunked logprob head (`logprobs.py`) and the host's losses weighted to
their share of the mini-batch (`losses.py`), and keeps DDP's gradient buffers only while training
(`gradient_buffers.py`); MoE routing replay (`route_replay.py`) and router statistics
(`router_metrics.py`) hook into the model's routers."""
