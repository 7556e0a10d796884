"""What the native engine reports of a run (`NativeEngine.stats`): its steps and their host work per step, the
tokens made and wasted, the scheduler's counts, and with structured outputs the masks' work per constrained step.
The job's report holds them, and the benchmark prints some (docs/engine.md says what the timings measure)."""

from __future__ import annotations

from typing import Any


def step_stats(
    runner: Any, scheduler: Any, outputs: Any, loop_s: tuple[float, float, float], max_num_seqs: int
) -> dict[str, float]:
    """`runner`: a `ModelRunner` or a `RankGroup`; `loop_s`: the loop thread's own seconds admitting requests,
    scheduling steps and processing their tokens."""
    steps = max(runner.steps, 1)
    admit_s, schedule_s, process_s = loop_s
    eager_steps = runner.steps - runner.graph_steps
    return dict(
        steps=runner.steps,
        tokens_fed=runner.tokens_fed,
        admit_ms_per_step=1000 * admit_s / steps,
        schedule_ms_per_step=1000 * schedule_s / steps,
        process_ms_per_step=1000 * process_s / steps,
        collect_wait_ms_per_step=1000 * runner.collect_wait_s / steps,
        prep_ms_per_step=1000 * runner.prep_s / steps,
        fill_ms_per_step=1000 * runner.fill_s / steps,
        graph_steps=runner.graph_steps,
        mixed_graph_steps=runner.mixed_graph_steps,
        eager_steps=eager_steps,
        graph_launch_ms_per_step=1000 * runner.launch_s[0] / max(runner.graph_steps, 1),
        eager_launch_ms_per_step=1000 * runner.launch_s[1] / max(eager_steps, 1),
        output_tokens=outputs.tokens_out + outputs.forced_tokens,
        wasted_tokens=outputs.wasted,
        preemptions=scheduler.num_preemptions,
        decodes_sat_out=scheduler.sat_out,
        max_num_seqs=max_num_seqs,
        prefix_cache_hit_tokens=scheduler.prefix_hit_tokens,
    )


def constrained_stats(runner: Any, masks: Any, outputs: Any, grammars: Any) -> dict[str, float]:
    """The structured outputs' share of a run that had constrained steps (`runner.masked_steps` > 0)."""
    constrained = runner.masked_steps
    return dict(
        constrained_steps=constrained,
        mask_ms_per_constrained_step=1000 * masks.fill_s / constrained,
        mask_wait_ms_per_constrained_step=1000 * masks.wait_s / constrained,
        mask_calls_per_constrained_step=masks.fill_calls / constrained,
        constrained_steps_masked_at_launch=masks.started_at_launch,
        constrained_steps_masked_early=masks.started_early,
        constrained_steps_sampled_at_poll=masks.sampled_at_poll,
        constrained_steps_gated=runner.gated_steps,
        sampler_launch_ms_per_constrained_step=1000 * runner.sampler_launch_s / constrained,
        jump_forward_tokens=outputs.forced_tokens,
        grammars_compiled=grammars.compiled,
        grammar_cache_hits=grammars.cache_hits,
    )
