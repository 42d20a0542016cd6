"""What the expert-parallel block (parallel/expert_parallel.py) takes on beyond route,
dispatch, experts and combine, each idea a file of its own, composed in by the block's
constructor from the config:

    capacity.py        --capacity-factor: which assignments an expert keeps, decided in
                       the global token order (an Exscan over dp; under cp an Allgather)
    expert_tp.py       --tp with --model moe: every expert split over tp, Megatron's way
    shared_experts.py  --shared-experts: always-on experts beside the routed ones
    load_stats.py      the load and the routing ledger of each microbatch

DeepSeek-V3's routing (sigmoid scores, the balancing bias b, node-limited groups) is the
router's own (core/routing.py): the block hands it the config and b.
"""
