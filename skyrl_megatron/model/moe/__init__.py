"""Mixture-of-experts: `moe_config` onto Megatron's TransformerConfig and the routers (`settings.py`), the
MoE layer of our spec (`layer.py`) over grouped-GEMM experts (`experts.py`), and how tokens reach the
experts without host syncs: permutation by gathers (`token_permute.py`; its sums of each token's rows one
Triton pass on GPU, `row_sum_kernels.py`), regrouping between ranks and
local experts (`token_sort.py`), and, at EP > 1, the all-to-all dispatcher (`exchange_dispatcher.py`)
over device-sized dispatch and combine (`device_all_to_all.py`) over the row exchange between ranks
(`row_exchange.py`); and a layer's forward in two halves of its tokens whose all-to-alls overlap the
other half's experts (`split_overlap.py`, over `async_all_to_all.py`)."""
