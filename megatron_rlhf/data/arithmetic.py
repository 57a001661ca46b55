"""Arithmetic problems generated reproducibly from a seed: a math task a 135M model can learn.

SmolLM2-135M-Instruct solves almost no MAWPS word problem (1-3%), so an RL run on it shows no
learning in minutes; it answers single-digit multiplication about half the time (T=0.7;
notes/cpu-stack.md), which gives a correct/incorrect pair on almost every prompt and a visible
gain within about 15 steps. :func:`generate` writes such problems as JSONL rows
``{"input": "What is 7 times 8?", "target": "56", "op": "mul1", "a": 7, "b": 8}`` in the same
fields as MAWPS, so the ordinary prompt loader reads them; the files are registered datasets
(``data.prompts.DATASETS``: ``arithmetic_mul1``, ``arithmetic_add2`` and their ``_eval``
splits) and are written by

    .venv/bin/python -m megatron_rlhf.data.arithmetic            # data/arithmetic/*.jsonl, seed 0

(a test checks the committed files equal a fresh generation, so the data is its seed).

Kinds: ``mul1`` = the products a x b with a, b in 1..9 in four wordings each. The held-out eval
split is made of whole *unordered* products: a held-out {a, b} goes to ``mul1_eval.jsonl`` in both
orders (a x b and b x a), so training never sees an eval fact even commuted. The seed shuffles the
45 unordered products and takes each in turn while it fits, until 32 of the 81 ordered problems are
held out (seed 0: 14 pairs a != b in both orders and 4 squares, 18 products; 128 rows, every
wording 32 times);
training gets the other 49 ordered problems (``mul1.jsonl``, 196 rows). ``add2`` = sums of two
random two-digit numbers (400 train, 32 eval), no unordered pair {a, b} in both splits or twice.
Rows are shuffled by the seed. Each row carries ``product`` (mul1: ``"a x b"`` with a <= b; add2:
``"a + b"``), the id of its unordered problem: the cluster of a cluster-robust standard error
(``trainer.evaluate.cluster_se``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

__all__ = ["WORDINGS", "generate", "product_id", "write_jsonl", "FILES"]

WORDINGS = {
    "mul1": ("What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?",
             "Compute {a} x {b}."),
    "add2": ("What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
             "Compute {a} + {b}."),
}
"""The problem wordings per kind (all four are used for mul1; add2 picks one per problem)."""

FILES = {("mul1", "train"): "data/arithmetic/mul1.jsonl", ("mul1", "eval"): "data/arithmetic/mul1_eval.jsonl",
         ("add2", "train"): "data/arithmetic/add2.jsonl", ("add2", "eval"): "data/arithmetic/add2_eval.jsonl"}
"""Repo-relative files of the registered datasets (``arithmetic_<kind>`` and ``arithmetic_<kind>_eval``)."""


def generate(kind: str, seed: int = 0, split: str = "train", n: int = 400, num_eval: int = 32) -> list[dict]:
    """The rows of arithmetic dataset ``kind``, split ``split``, for ``seed``.

    The two splits share no *unordered* problem ({a, b}: neither a x b nor b x a of an eval problem
    is trained on), so the held-out eval measures the skill on unseen facts, not recall:
    ``mul1`` holds out ``num_eval`` of its 81 ordered problems as whole unordered products (the
    seed's order of the 45 products {a, b}, a <= b; a product is taken when its 1 or 2 ordered
    problems fit in what is left of ``num_eval``), all four wordings of each: ``4 x num_eval`` eval
    rows, ``4 x (81 - num_eval)`` train rows; ``add2`` draws ``n`` train and ``num_eval`` eval sums
    (one random wording each), no unordered pair twice.

    Args:
        kind: ``mul1`` (a x b, a and b in 1..9) or ``add2`` (two random two-digit numbers).
        seed: the only source of randomness (``random.Random(f"{kind}:{seed}")``).
        split: ``train`` or ``eval``.
        n: train rows of ``add2``.
        num_eval: held-out ordered problems.
    Returns:
        rows ``{"input", "target", "op", "a", "b", "product"}`` (``target`` a decimal string,
        ``product`` the unordered problem's id, e.g. ``"6 x 8"`` for 6 x 8 and 8 x 6), shuffled.
    Raises:
        ValueError: unknown ``kind`` or ``split``, ``n < 1`` or a bad ``num_eval``.
    """
    if kind not in WORDINGS:
        raise ValueError(f"arithmetic kind {kind!r}: expected one of {sorted(WORDINGS)}")
    if split not in ("train", "eval"):
        raise ValueError(f"arithmetic split {split!r}: expected train or eval")
    if n < 1 or not 1 <= num_eval < (81 if kind == "mul1" else 10**4):
        raise ValueError(f"arithmetic n={n}, num_eval={num_eval}: need n >= 1 and 1 <= num_eval < 81 (mul1)")
    rng = random.Random(f"{kind}:{seed}")
    if kind == "mul1":
        products = [(a, b) for a in range(1, 10) for b in range(a, 10)]   # 45 unordered
        rng.shuffle(products)
        held, left = set(), num_eval
        for a, b in products:
            size = 1 if a == b else 2
            if size <= left:
                held.add((a, b))
                left -= size
        pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)
                 if ((min(a, b), max(a, b)) in held) == (split == "eval")]
        rows = [_row(kind, w, a, b) for a, b in pairs for w in WORDINGS[kind]]
    else:
        seen: dict[tuple[int, int], str] = {}
        unordered: set[tuple[int, int]] = set()
        while len(seen) < n + num_eval:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (min(a, b), max(a, b)) not in unordered:
                unordered.add((min(a, b), max(a, b)))
                seen[(a, b)] = rng.choice(WORDINGS[kind])
        items = list(seen.items())
        items = items[n:] if split == "eval" else items[:n]
        rows = [_row(kind, w, a, b) for (a, b), w in items]
    rng.shuffle(rows)
    return rows


def product_id(kind: str, a: int, b: int) -> str:
    """The id of the unordered problem {a, b}: ``"3 x 7"`` (mul1) or ``"13 + 75"`` (add2), smaller first."""
    lo, hi = min(a, b), max(a, b)
    return f"{lo} x {hi}" if kind == "mul1" else f"{lo} + {hi}"


def _row(kind: str, wording: str, a: int, b: int) -> dict:
    value = a * b if kind == "mul1" else a + b
    return {"input": wording.format(a=a, b=b), "target": str(value), "op": kind, "a": a, "b": b,
            "product": product_id(kind, a, b)}


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write ``rows`` as JSONL (one object per line, keys in insertion order); returns the path."""
    from megatron_rlhf.utils.atomic import write_text

    path = Path(path)
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                    help="repo root (files go to ROOT/data/arithmetic/)")
    args = ap.parse_args(argv)
    for (kind, split), rel in FILES.items():
        print(write_jsonl(generate(kind, args.seed, split), args.root / rel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
