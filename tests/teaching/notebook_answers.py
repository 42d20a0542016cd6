"""The solutions of the lesson notebooks' exercises, kept out of the notebooks.

A notebook in lessons/ hands its exercises out unsolved: each answer is a line of an
exercise cell, `name = None  # your formula` (a tuple of names: `a, b = None, None`), and
the cell's check waits until it is written (minipar.teaching.classroom.answered). This
file holds what a solved line reads:

    ANSWERS[notebook stem][the line's left side] = its right side, as source text

`make course` (tests/teaching/notebooks.py) runs each exercise cell once more with these
written in, right after it ran as handed out, so every check is proven passable -- the
solved run must print `check passed` -- and a fast test (test_notebooks.py) holds the two
in step: every `# your`
line of lessons/*.ipynb is `None` as stored and has its answer here, every answer here
has its line. A notebook that adds an exercise adds its line here.
"""

from __future__ import annotations

ANSWERS: dict[str, dict[str, str]] = {
    "05_tp_vs_pp": {
        "tp_wire": "2 * L * M * (B // M) * d * 8 * 2 * (tp - 1) / tp",
        "pp_wire": "2 * M * (B // M) * d * 8",
        "smallest_m": "28",
    },
    "07_zero": {
        "stage2": "8 * psi + (8 + 16) * psi / n",
        "ratio": "1.5",
        "stage1_gb": "(2 + 2) * 7.5e9 / 1e9 + 12 * 7.5e9 / 64 / 1e9",
    },
    "08_bugs": {
        "answer_lr": "0.05 * 4",
        "missing_op, expected_calls": '"Allreduce", 2 * small["layers"]',
    },
    "10_transformer": {
        "dp_wire": "2 * (n - 1) / n * psi * 8",
        "held": "(8 + 8 + 16) * psi_text",
        "predictable": "8",
        "floor": "np.log(V) * (T - predictable) / T",
    },
    "11_transformer_tp": {
        "calls, elements": "4 * L, 4 * L * B * T * d",
        "extra_calls, extra_elements": "4, 2 * B * T * d + B * T + 2 * B * T",
        "saved": "(V - V // n) * (2 * d + 1) * 8",
    },
    "12_context_parallel": {
        "ring0": "B * H * (T // cp) ** 2",
        "pairs": "(0 + 1) + (2 * cp - 1 + 1)",
        "zigzag0": "B * H * pairs * (T // (2 * cp)) ** 2",
        "calls, elements": "8 * L, 8 * L * B * (T // cp) * d",
        "ratio": "(8 * (T // cp)) / (4 * T)",
    },
    "13_recipes": {
        "elements": "M * L * 4 * b * T * d",
    },
    "14_mixed_precision": {
        "zero2": "2 + (4 + 4 + 8) / n",
        "S": "2.0 ** 13",
    },
    "16_serving": {
        "reads": '((params - m.vocab * m.d_model) * 2 + m.layers * 4096 * sizes["kv_width"] * 2)'
                 " / 8 / hw.hbm_bw",
    },
    "18_diloco": {
        "peak": '2 * (K - 1) / K * 8 * sum(n for name, n in numbers.items()'
                ' if not name.startswith("blocks.") or name.startswith("blocks.0."))',
    },
}
