"""The report's large-model section (`eval.report_large`) from a record as
`scripts/large_model_layouts.py --json` writes it."""

import json

from disco_jax.eval import report_large


def _record():
    def row(kind, ms, gb, same=()):
        return {
            "kind": kind,
            "iteration_us": ms * 1e3,
            "peak_bytes": gb * 1e9,
            "mfu": 0.2,
            "same_program_as": list(same),
        }

    return {
        "args": {
            "memory_gb": 80.0,
            "batch": 16,
            "layers": 32,
            "width": 4096,
            "heads": 32,
            "vocab": 32000,
            "seq": 2048,
            "scan": True,
            "remat": "dots",
            "cluster": "8xH100-NVLink",
            "only": None,
        },
        "model": "GPT",
        "parameters": 6.6e9,
        "cluster": "8xH100-NVLink",
        "rows": {
            "8x1 by hand: data parallel": row("by hand", 500, 111, ["8x1 Embed: replicated, blocks: replicated"]),
            "8x1 Embed: replicated, blocks: replicated": row("disco-jax", 500, 111),
            "8x1 by hand: FSDP": row("by hand", 400, 40),
            "4x2 Embed: fsdp_tp, blocks: fsdp_tp_sp": row("disco-jax", 380, 30),
        },
        "search": {
            "chosen": {"plan": "4x2 Embed: fsdp_tp, blocks: fsdp_tp_sp"},
            "reason": "the cheapest",
            "candidates": [],
        },
    }


def test_the_section_names_the_choice_its_ratio_and_what_does_not_fit():
    text = report_large.table(_record())
    assert "**4x2 Embed: fsdp_tp, blocks: fsdp_tp_sp** (chosen)" in text
    assert "Plan / best hand-written configuration that fits: **0.950**" in text
    assert "Over 80 GB by hand: 8x1 by hand: data parallel" in text
    # One row per program: the replicated plan is named beside the hand-written data parallel.
    assert "\n| 8x1 Embed: replicated, blocks: replicated |" not in text
    assert text.count("\n| ") == 1 + 3
    assert "| 8x1 by hand: data parallel | by hand | 500.0 | 111.00 | 20.0% | **no** |" in text


def test_the_remat_comparison_is_its_own_table(tmp_path):
    folder = tmp_path / "large_model"
    folder.mkdir()
    args = {"layers": 32, "width": 4096, "seq": 2048, "batch": 8, "cluster": "8xH100-NVLink"}
    record = {
        "args": args,
        "by hand: nn.remat dots": {"iteration_us": 310770.0, "peak_bytes": 22.45e9},
        "disco-jax: remat dots": {"iteration_us": 313570.0, "peak_bytes": 22.59e9},
    }
    (folder / "remat_gpt32.json").write_text(json.dumps(record))
    (folder / "gpt.json").write_text(json.dumps(_record()))
    intro, first, second = report_large.blocks(tmp_path)
    remat = first if "Rematerialization" in first else second
    assert "| disco-jax: remat dots | 313.57 | 22.59 |" in remat and "remat_choice.py --layers 32" in remat
    assert "(chosen)" in (second if remat is first else first)
