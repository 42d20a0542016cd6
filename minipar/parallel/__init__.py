"""The strategies, one file each: where to start reading, what to run, what proves it.

Every strategy is a seed file you can read top-down, the source's idea as minipar runs
it, with what goes beyond the source in files beside it ("beyond it"); its collectives
are called at its own lines (through `comm/collectives.py`'s ledgered `Group`). Read them
in this order; `compose/parallelize.py` (`parallelize`) shows how they wrap each other.

data parallelism
    data_parallel.py: allreduce_gradients (naive), bucketed_allreduce, OverlappedAllreduce
    (buckets started inside backward); buckets.py: pack, unpack; dp_hooks.py: Piece, the
    marker nodes that say a piece's gradients are complete; dp_updater.py: the Updater
    protocol and DataParallel (a sync, then the optimizer, with the masters it holds).
    Lesson 01_data_parallel. Tests: tests/parallel/test_data_parallel.py.
ZeRO 1 / 2 / 3
    zero.py: Zero1, Zero2, Zero3. Lesson 07_zero. Tests: tests/parallel/test_zero.py.
tensor parallelism (and sequence parallelism)
    tensor_parallel.py: ColumnParallelLinear, RowParallelLinear, TensorParallelBlock,
    TensorParallelAttention; sequence_parallel.py (a layer on those linears):
    AllgatherThenColumn, RowThenReduceScatter, SequenceParallelBlock,
    SequenceParallelAttention, sequence_parallel_hooks, allreduce_sequence_parallel_grads,
    ReplicatedOverTp. Lessons 02_tensor_parallel,
    11_transformer_tp. Tests: tests/parallel/test_tensor_parallel.py,
    tests/parallel/test_gpt_tensor_parallel.py.
vocabulary parallelism
    vocab_parallel.py: VocabParallelEmbedding, VocabParallelHead, parallel_cross_entropy.
    Lesson 11_transformer_tp. Tests: tests/parallel/test_gpt_tensor_parallel.py.
expert parallelism
    expert_parallel.py: ExpertParallelBlock (route, dispatch, run_local_experts, combine).
    Beyond it: moe/capacity.py: Capacity (in the global token order);
    moe/expert_tp.py: TensorParallelExpert, run_local_experts_split (each expert over
    tp); moe/shared_experts.py: SharedExperts; moe/load_stats.py: load_stats, group_stats.
    Lesson 03_expert_parallel. Tests: tests/parallel/test_expert_parallel.py.
pipeline parallelism
    pipeline/schedules.py and pipeline/v_schedules.py (the orders, as data),
    pipeline/executor.py (StageWorker, forward_backward: one chain of stages, GPipe,
    1F1B, interleaved), pipeline/v_executor.py (TwoChunks, sum_the_two_copies: the V
    layouts, DualPipe's two chains, B and W apart), pipeline/simulator.py.
    Lessons 04_pipeline_parallel, 05_tp_vs_pp. Tests: tests/parallel/test_pipeline_parallel.py,
    tests/parallel/test_pipeline_schedules.py, tests/parallel/test_bubble.py.
context parallelism
    context_parallel.py: allgather_attention, ring_attention, ulysses_attention.
    Lesson 12_context_parallel. Tests: tests/parallel/test_context_parallel.py.
serving with a KV cache
    kvcache.py: the cache split by heads (tp) and positions (cp), merged by log-sum-exp;
    run/decode.py runs the loop, run/generate.py the command. Lesson 16_serving.
    Tests: tests/run/test_generate.py.
all of them at once
    compose/parallelize.py: parallelize. Lessons 06_hybrid, 13_recipes. Tests:
    tests/parallel/test_hybrid.py, tests/parallel/test_every_mesh.py,
    tests/parallel/test_gpt_parallel.py.

The pipeline's own folder, bottom-up: `instructions.py` (what a rank does: F, B, W,
send, recv), `chunk_layout.py` (which chunk of layers sits on which rank, and who
talks to whom), `schedules.py` and `v_schedules.py` (the orders, as data),
`simulator.py` (the orders played on a clock), `executor.py` (the orders run by MPI),
`v_executor.py` (two chunks per rank, B and W apart), `stage_trace.py` (what --trace
records around the worker, and the gathered timeline).
"""
