"""The transformer: a small GPT-2-style decoder, `--model gpt` and `--model gpt-moe`.

What this file teaches: the model real systems split (Radford et al. 2019, GPT-2;
Megatron-LM splits exactly this), built from the MLP's own pieces plus attention
(attention.py). docs/design.md, "The transformer", is the exact math:

    h0  = tok[x] + pos[0:T]                       x (B, T) token ids, h (B, T, d)
    h'  = h + concat_h(softmax(causal(q_h k_h^T / sqrt(dh))) v_h) @ Wo + bo,
          q = LN1(h) Wq + bq, k and v the same    (all H heads in one attention node)
    h_l = h' + FFN(LN2(h'))                       nn.DenseBlock or nn.MoEBlock, named ln2
    logits = LN_f(h_L) @ Wh + bh                  (B, T, V)
    loss = mean over the B*T positions of CE(logits, y) + sum_l aux_l

Every layer except attention is position-wise: the linears and LayerNorms of nn.py
take (B, T, d) and treat every position as a row, and the MoE FFN routes the B*T
positions as tokens (row, then position). So the second half of a block IS the MLP
model's block, with its LayerNorm named `ln2`, and every strategy that splits an MLP
block (expert parallelism, ...) splits this one unchanged.

The model is an `nn.Model`: an `Embedding` piece, `Block`s that take and return
(B, T, d), a `Head` piece -- so a pipeline stage cuts it like the MLP, and what
crosses a stage boundary is (B/(M dp), T, d).

Run it: `python -m minipar train --model gpt --check`, or on a mesh
`mpiexec -n 4 python -m minipar train --model gpt-moe --dp 2 --ep 2 --pp 2 --check`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minipar import placement
from minipar.core import attention, fused_layers, nn
from minipar.core.autograd import Tensor
from minipar.core.recompute import recomputed
from minipar.placement import Shard


class Embedding(nn.Module):
    """h0 = tok[x] + pos[positions]: token ids (B, T) -> (B, T, d), the first piece.

    `positions` are the global positions of the T columns this rank holds (0..T-1 when
    it holds the whole sequence), one shard of them over the group `positions_over`
    (context parallelism: placement checking needs to know)."""

    def __init__(self, full: dict[str, np.ndarray], positions: np.ndarray | None = None,
                 positions_over: placement.AxisGroup | None = None) -> None:
        self.tok = nn.Parameter(full["tok_embed.weight"], "tok_embed.weight")
        self.pos = nn.Parameter(full["pos_embed.weight"], "pos_embed.weight")
        self.positions = positions  # context parallelism: the positions this rank holds
        self.positions_over = positions_over

    def __call__(self, x: Tensor, positions: np.ndarray | None = None) -> Tensor:
        positions = self.positions if positions is None else positions
        positions = np.arange(x.shape[1]) if positions is None else positions
        if placement.ON and self.positions_over is not None:  # my shard of the positions
            positions = placement.place(Tensor(positions), self.positions_over, Shard(0))
        # x (B, T) integer ids; (B, T, d) + (T, d): every sequence gets the same position rows
        return attention.embedding(self.tok, x) + attention.embedding(self.pos, positions)


class Attention(nn.Module):
    """h + proj(attention(LN1(h))): multi-head causal self-attention, pre-LN, residual.

    Separate q, k, v linears (d, d), each column block h*dh..(h+1)*dh being head h;
    the H heads run as one batched node (attention.attention), then one proj. The key
    bias is handed to that node, which knows its gradient is exactly 0. `core` replaces
    that node: context parallelism passes its strategy (context_parallel.py), called
    the same way on the positions this rank holds.

    `selective=True` is Korthikanti et al.'s selective recomputation: the attention core
    (scores, softmax: the (B, H, T, T) arrays) is not kept for the backward but computed
    again from q, k, v there (`recomputed`). Tensor parallelism splits this block by
    heads (tensor_parallel.TensorParallelAttention overrides `enter` and the linears)."""

    def __init__(self, full: dict[str, np.ndarray], index: int, heads: int,
                 sync: str | None = "dp", selective: bool = False,
                 core: Callable[..., Tensor] | None = None) -> None:
        p = f"blocks.{index}"
        self.heads = heads
        self.selective = selective
        self.core = attention.attention if core is None else core
        self.ln = nn.LayerNorm(full, f"{p}.ln1")
        self.q = nn.Linear(full, f"{p}.attn.q", sync=sync)
        self.k = nn.Linear(full, f"{p}.attn.k", sync=sync)
        self.v = nn.Linear(full, f"{p}.attn.v", sync=sync)
        self.proj = nn.Linear(full, f"{p}.attn.proj", sync=sync)

    def enter(self, a: Tensor) -> Tensor:
        """Where LN1(h) enters the q, k, v linears: nothing to do on one rank."""
        return a

    def __call__(self, h: Tensor) -> Tensor:
        a = self.enter(self.ln(h))                                # (B, T, d)
        q, v = self.q(a), self.v(a)                               # (B, T, d) @ (d, d) each
        k = fused_layers.linear(a, self.k.weight)                        # bk: inside attention
        core = recomputed(self.core) if self.selective else self.core
        o = core(q, k, v, self.heads, key_bias=self.k.bias)       # (B, T, H dh)
        return h + self.proj(o)                                   # (B, T, d) @ (d, d)


class Block(nn.Module):
    """One transformer block: attention, then the FFN block (dense or MoE) on h'.

    `ffn` is any block of the MLP models built with its LayerNorm named `ln2`
    (nn.DenseBlock, nn.MoEBlock, expert_parallel.ExpertParallelBlock): it maps h' to
    h' + FFN(LN2(h')) and returns its aux loss, on (B, T, d) as on (B, d)."""

    def __init__(self, full: dict[str, np.ndarray], index: int, heads: int,
                 ffn: nn.Module, attn: nn.Module | None = None) -> None:
        self.attn = Attention(full, index, heads) if attn is None else attn
        self.ffn = ffn

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.ffn(self.attn(h))                             # (B, T, d), aux

    def partial_over_tp(self) -> list[nn.Parameter]:
        """Sequence parallelism: the replicated parameters of both halves that see only
        this rank's positions (sequence_parallel.py `allreduce_sequence_parallel_grads`)."""
        return [p for part in (self.attn, self.ffn) if hasattr(part, "partial_over_tp")
                for p in part.partial_over_tp()]


class Head(nn.Module):
    """logits = LN_f(h) @ Wh + bh: (B, T, d) -> (B, T, V), the last piece."""

    def __init__(self, full: dict[str, np.ndarray]) -> None:
        self.ln_f = nn.LayerNorm(full, "ln_f")
        self.head = nn.Linear(full, "head")

    def __call__(self, h: Tensor) -> Tensor:
        return self.head(self.ln_f(h))                            # (B, T, d) @ (d, V)


def reference_ffn(cfg: nn.ModelConfig, full: dict[str, np.ndarray]
                  ) -> Callable[[int], nn.Module]:
    """Block index -> the one-process FFN block of that transformer block (ln2)."""
    if cfg.is_moe:
        return lambda index: nn.MoEBlock(full, index, cfg, ln="ln2")
    return lambda index: nn.DenseBlock(full, index, ln="ln2")


def build_reference(cfg: nn.ModelConfig, full: dict[str, np.ndarray]) -> nn.Model:
    """The single-process transformer holding every parameter."""
    ffn = reference_ffn(cfg, full)
    blocks: list[nn.Module] = [Block(full, i, cfg.heads, ffn(i)) for i in range(cfg.layers)]
    return nn.Model(Embedding(full), blocks, Head(full))

