"""What the planner is asked about: a model's shapes and a cluster's GPUs, and well-known ones.

What this file teaches. A model is sized by a handful of published numbers (layers,
width, heads, FFN width, vocabulary, sequence length, experts); every parameter count,
activation byte and FLOP the planner uses follows from them (planner/workloads.py: `transformer`).
A cluster is sized by four more: memory and peak FLOP/s per GPU, bandwidth inside a
node and between nodes. Each preset below names where its numbers were published, so a
reader can check them; `python -m minipar plan --preset NAME --cluster NAME` starts from
one and any flag overrides a field.

Two model styles, because the two generations differ in what a layer holds:
  gpt    LayerNorm (weight and bias), biases on every linear layer, learned positions
         (s x d), dropout (its masks are part of Megatron's activation count),
         standard attention (the s x s scores are stored);
  llama  RMSNorm (weight only), no biases, rotary positions (no parameters), no dropout,
         FlashAttention-style attention (the scores are recomputed, never stored).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer by its published shapes: the numbers the planner prices,
    no arrays (the model that computes is core/nn.py's `Model`).

    `kv_heads` (grouped-query attention) defaults to `heads` and `head_dim` to
    d_model / heads; `attention` overrides the attention parameters per layer (for
    attention that is not multi-head, e.g. DeepSeek's latent attention: `mla_params`).
    MoE: from layer `dense_layers` on, the FFN is `experts` routed experts of width
    `expert_d_ff` (each token takes `top_k`) plus `shared_experts` always-on ones."""

    name: str
    layers: int
    d_model: int
    heads: int
    d_ff: int
    vocab: int
    seq_len: int
    ffn_matrices: int            # 2: GELU MLP (up, down); 3: SwiGLU (gate, up, down)
    style: str                   # "gpt" or "llama" (see the module docstring)
    kv_heads: int | None = None
    head_dim: int | None = None
    tied: bool = False           # the output head reuses the input embedding
    experts: int = 0
    top_k: int = 0
    expert_d_ff: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    attention: int | None = None  # parameters of one layer's attention, if not multi-head
    routing_bias: bool = False   # balanced by a bias on the routing scores (DeepSeek-V3's
    #                              auxiliary-loss-free balancing), not an auxiliary loss


@dataclass(frozen=True)
class Cluster:
    """GPUs and links: GB and dense bf16 TFLOP/s per GPU, GB/s per GPU and direction;
    `hbm_bw` GB/s of the GPU's own memory (what a decode step reads its weights and KV
    cache at: planner/serving.py); `fp8_flops` dense FP8 TFLOP/s (0: no FP8 tensor
    cores, `plan --fp8` refused)."""

    name: str
    gpu_memory: float
    flops: float
    intra_bw: float
    inter_bw: float
    node_size: int = 8
    latency_us: float = 5.0
    hbm_bw: float = 0.0
    fp8_flops: float = 0.0


def mla_params(d: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int,
               v: int) -> int:
    """Parameters of one multi-head latent attention layer (DeepSeek-V2/V3): queries
    through a rank-`q_rank` bottleneck (down, its RMSNorm, up to heads x (nope + rope)),
    keys and values through a rank-`kv_rank` one (down to kv_rank + a shared rope key,
    its RMSNorm, up to heads x (nope + v)), and the output projection heads x v -> d."""
    queries = d * q_rank + q_rank + q_rank * heads * (nope + rope)
    keys_values = d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
    return queries + keys_values + heads * v * d


def megatron_gpt(billions: str, heads: int, d: int, layers: int) -> ModelShape:
    """One of the GPT models of Narayanan et al. 2021 (Megatron-LM), Table 1: vocabulary
    51,200 and sequence length 2048 for all, a 4d-wide GELU MLP, the head tied to the
    embedding."""
    return ModelShape(f"Megatron GPT {billions}", layers, d, heads, 4 * d, 51200, 2048, 2, "gpt",
                 tied=True)


# (name, attention heads, hidden size, layers, tensor-parallel size t, pipeline-parallel
# size p, GPUs, batch size, achieved teraFLOP/s per GPU): Table 1 of Narayanan et al.,
# "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (SC 2021), on DGX A100 80GB nodes (Selene); data-parallel size d = GPUs / (t p).
MEGATRON_TABLE_1 = (
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

MODELS: dict[str, ModelShape] = {
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1: 96 layers,
    # d_model 12288, 96 heads of 128, context 2048; GPT-2's BPE vocabulary of 50257
    # (Radford et al. 2019), the head tied to the embedding as in GPT-2.
    "gpt3-175b": ModelShape("GPT-3 175B", 96, 12288, 96, 4 * 12288, 50257, 2048, 2, "gpt",
                       tied=True),
    **{f"megatron-{row[0].lower()}": megatron_gpt(*row[:4]) for row in MEGATRON_TABLE_1},
    # Llama Team, "The Llama 3 Herd of Models" (2024), Table 3: layers, model and FFN
    # dimension, heads, 8 key/value heads; SwiGLU; pre-training sequences of 8192
    # tokens; vocabulary 128,256 (the models' config.json on the Hugging Face hub).
    "llama3-8b": ModelShape("Llama 3 8B", 32, 4096, 32, 14336, 128256, 8192, 3, "llama",
                       kv_heads=8),
    "llama3-70b": ModelShape("Llama 3 70B", 80, 8192, 64, 28672, 128256, 8192, 3, "llama",
                        kv_heads=8),
    "llama3-405b": ModelShape("Llama 3 405B", 126, 16384, 128, 53248, 128256, 8192, 3, "llama",
                         kv_heads=8),
    # Le Scao et al. 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language
    # Model": 70 layers, hidden 14336, 112 heads, sequences of 2048, a GELU MLP of 4d,
    # the head tied to the embedding; vocabulary 250,880 (the model's config.json on the
    # Hugging Face hub: the tokenizer's 250,680 padded). Its ALiBi has no position
    # parameters and its embedding a LayerNorm: the gpt style's learned positions stand
    # in for both (29 M of 176 B parameters).
    "bloom-176b": ModelShape("BLOOM 176B", 70, 14336, 112, 4 * 14336, 250880, 2048, 2, "gpt",
                        tied=True),
    # Jiang et al. 2024, "Mixtral of Experts", Table 1: dim 4096, 32 layers, head_dim 128,
    # hidden_dim 14336, 32 heads, 8 kv heads, context 32768, vocabulary 32000, 8 experts,
    # top 2 (46.7 B parameters, 12.9 B active).
    "mixtral-8x7b": ModelShape("Mixtral 8x7B", 32, 4096, 32, 14336, 32000, 32768, 3, "llama",
                          kv_heads=8, experts=8, top_k=2, expert_d_ff=14336),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 4.2: 61 layers, hidden
    # 7168, 128 heads, MLA with KV compression 512, query compression 1536, per-head
    # dims 128 + 64 (rope) for keys, 128 for values; all FFNs MoE but the first 3 (width
    # 18432, config.json), 1 shared + 256 routed experts of 2048, 8 per token;
    # vocabulary 129280; pre-training sequences of 4096 (671 B parameters, 37 B active;
    # the multi-token prediction module is left out); section 2.1.2: balanced by a bias
    # per expert updated from each step's load (auxiliary-loss-free), its batch-wise
    # auxiliary loss gone (a sequence-wise one, computed within a sequence, remains).
    "deepseek-v3": ModelShape("DeepSeek-V3", 61, 7168, 128, 18432, 129280, 4096, 3, "llama",
                         head_dim=128, experts=256, top_k=8, expert_d_ff=2048,
                         shared_experts=1, dense_layers=3, routing_bias=True,
                         attention=mla_params(7168, 128, 1536, 512, 128, 64, 128)),
}

CLUSTERS: dict[str, Cluster] = {
    # NVIDIA A100 datasheet: 80 GB, 312 TFLOP/s dense BF16, NVLink 600 GB/s in all (300
    # each way), HBM2e 2,039 GB/s (SXM); DGX A100 datasheet: 8 GPUs and 8 ConnectX-6 HDR
    # 200 Gb/s (25 GB/s) NICs.
    "dgx-a100-80gb": Cluster("DGX A100 80GB", 80, 312, 300, 25, hbm_bw=2039),
    # NVIDIA H100 SXM datasheet: 80 GB, 989 TFLOP/s dense BF16, NVLink 900 GB/s in all
    # (450 each way), HBM3 3.35 TB/s, 1979 TFLOP/s dense FP8; DGX H100: 8 GPUs and 8
    # ConnectX-7 400 Gb/s (50 GB/s) NICs.
    "h100": Cluster("H100 SXM (DGX H100)", 80, 989, 450, 50, hbm_bw=3350, fp8_flops=1979),
    # BLOOM's cluster (Le Scao et al. 2022, its hardware section): Jean Zay, 8 A100
    # 80GB a node joined by NVLink (the A100 datasheet's 300 GB/s each way), 4 Omni-Path
    # links of 100 Gb/s a node: 50 GB/s a node, 6.25 GB/s per GPU between nodes.
    "jean-zay-a100": Cluster("Jean Zay A100 80GB (BLOOM's cluster)", 80, 312, 300, 6.25,
                             hbm_bw=2039),
    # H800: H100's compute and memory, NVLink cut to 400 GB/s in all; DeepSeek-V3
    # Technical Report, section 3.2.2: "NVLink offers a bandwidth of 160 GB/s, roughly
    # 3.2 times that of IB (50 GB/s)" (what its kernels reach), 8 GPUs a node.
    # (its memory, HBM3 at 3.35 TB/s, and FP8 rate, 1979 TFLOP/s dense, are the H100's).
    "h800": Cluster("H800 (DeepSeek-V3's cluster)", 80, 989, 160, 50, hbm_bw=3350,
                    fp8_flops=1979),
}
