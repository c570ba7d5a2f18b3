"""`sparkctl plan`: the memory plan per rank and the exact --kv-cache-memory-bytes, offline."""

from __future__ import annotations

import click
from rich.table import Table

from ..errors import CheckFailed
from ..output import console, emit_json, warn
from ..spec.planner import GIB, gb, make_plan
from ._checkpoint import checkpoint_for


def memory_figure(s: object, node_memory: int | None) -> str:
    """Which node-memory figure the plan used, in words: --node-memory, or NODE_MEMORY_BYTES and where
    it came from. `plan` never reads a node's memory; `check` and `up` judge each node's own."""
    from ..spec.settings import Settings

    assert isinstance(s, Settings)
    if node_memory:
        return "--node-memory"
    return (f"{s.describe('NODE_MEMORY_BYTES')}, not read from the nodes (`check` plans against each node's "
            "MemTotal and judges its free memory; `up` waits for it)")


@click.command("plan")
@click.option("--node-memory", type=int, metavar="BYTES", help="Plan for this node memory (default NODE_MEMORY_BYTES).")
@click.option("--local", "local_only", is_flag=True, help="Read MODEL on this machine only (never over SSH).")
@click.pass_obj
def command(g: object, node_memory: int | None, local_only: bool) -> None:
    """Plan weights, KV cache and overhead per rank; refuse a plan that does not fit (exit 1)."""
    from ..options import Globals

    assert isinstance(g, Globals)
    s = g.settings()
    warn(s.warnings)
    plan = make_plan(s, checkpoint_for(g, s, local_only=local_only), node_memory)
    memory_from = memory_figure(s, node_memory)
    if g.json:
        emit_json({"model": str(s.model), "recipe": s.recipe.name, "plan": plan.to_dict(),
                   "node_memory": {"bytes": plan.node_memory_bytes, "from": memory_from}})
    else:
        c = console(False)
        t = Table(title=f"memory plan per rank — {s.model} (recipe {s.recipe.name})", title_justify="left")
        t.add_column("term")
        t.add_column("bytes", justify="right")
        t.add_column("", justify="right", style="dim")
        t.add_row(f"weights: {gb(plan.weights_total)} of shards ÷ TP={plan.tp}",
                  f"{plan.weights_per_rank:,}", gb(plan.weights_per_rank))
        for term in plan.kv_terms:
            if term.state_bytes_per_layer:  # a fixed state per sequence (before padding to the page)
                t.add_row(f"  KV/sequence: {term.name} × {term.layers} layers", f"{term.state_bytes:,}", "")
            else:
                t.add_row(f"  KV/token: {term.name} × {term.layers} layers", f"{term.bytes_per_token:,}", "")
        stored = plan.kv_cache_dtype_effective
        t.add_row(f"KV per token (all layers, {stored}" + (f", asked {plan.kv_cache_dtype}" if stored !=
                  plan.kv_cache_dtype else "") + ")", f"{plan.kv_bytes_per_token:,}", "")
        blocks_per_seq = (plan.kv_blocks_per_rank - 1) // plan.max_full_seqs
        if plan.kv_group_layers:  # layers of several kinds of cache: one pool of groups of kv_group_layers pages
            page = plan.kv_block_bytes // plan.kv_group_layers
            t.add_row(f"KV block: {plan.kv_block_tokens} tokens, a page of {page:,} B × {plan.kv_group_layers} "
                      "layers (one KV cache group)", f"{plan.kv_block_bytes:,}", "")
            t.add_row(f"KV blocks per rank: {blocks_per_seq:,} per sequence (every group) × {plan.max_full_seqs} seq "
                      "+ 1 null block", f"{plan.kv_blocks_per_rank:,}", "")
        else:
            t.add_row(f"KV block: {plan.kv_block_tokens} tokens × {plan.kv_bytes_per_token:,} B",
                      f"{plan.kv_block_bytes:,}", "")
            t.add_row(f"KV blocks per rank: ⌈⌈{plan.max_model_len:,} / DCP={plan.dcp}⌉ / {plan.kv_block_tokens}⌉ = "
                      f"{blocks_per_seq:,} × {plan.max_full_seqs} seq + 1 null block", f"{plan.kv_blocks_per_rank:,}", "")
        t.add_row("KV cache per rank (the minimum vLLM accepts)", f"{plan.kv_cache_memory_bytes:,}",
                  gb(plan.kv_cache_memory_bytes))
        t.add_row(f"overhead (CUDA/NCCL, {plan.overhead_bytes / GIB:g} GiB)", f"{plan.overhead_bytes:,}",
                  gb(plan.overhead_bytes))
        t.add_row("total per rank", f"{plan.per_rank_total:,}", gb(plan.per_rank_total), style="bold")
        t.add_row(f"node memory − OS reserve ({plan.os_reserve_bytes / GIB:g} GiB)", f"{plan.available:,}",
                  gb(plan.available))
        t.add_row("headroom", f"{plan.headroom:,}", gb(plan.headroom),
                  style="green" if plan.headroom >= 0 else "red")
        c.print(t)
        c.print(f"KV backend: {plan.kv_backend} on compute capability {plan.compute_capability} "
                f"({plan.compute_capability_source}); {plan.kv_backend_why}", markup=False)
        c.print(f"planned against node memory {gb(plan.node_memory_bytes)}: {memory_from}", markup=False)
        for note in plan.notes:
            c.print(f"note: {note}")
        c.print(f"--kv-cache-memory-bytes {plan.kv_cache_memory_bytes}")
    problems = plan.problems()
    if problems:
        raise CheckFailed("plan refused: " + "\n  ".join(problems))
