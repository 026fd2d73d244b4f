"""Generate deploy/grafana-dashboard.json (run: python deploy/make_grafana_dashboard.py).

The dashboard shows the same signals as the server's own /dashboard page, from the stable
Prometheus metric names (prefix ``verifypd_``, label ``model``). Import it in Grafana and pick
the Prometheus data source that scrapes verifypd (see deploy/prometheus.yml).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("grafana-dashboard.json")
SEL = '{model=~"$model"}'
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def q(expr: str, legend: str = "") -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ""}


def quantile(metric: str, p: float, by: str = "", legend: str = "") -> dict:
    group = f"le, {by}" if by else "le"
    expr = f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{SEL}[{RATE}])))"
    return q(expr, legend or f"p{round(p * 100)}")


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[dict]:
    prefix = f"{{{{{by}}}}} " if by else ""
    return [quantile(metric, p, by, f"{prefix}p{round(p * 100)}") for p in qs]


def mean(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    num = f"sum{group} (rate({metric}_sum{SEL}[{RATE}]))"
    return f"{num} / sum{group} (rate({metric}_count{SEL}[{RATE}]))"


def ratio(num: str, den: str) -> str:
    return f"sum(rate({num}{SEL}[{RATE}])) / sum(rate({den}{SEL}[{RATE}]))"


def panel(
    kind: str,
    title: str,
    targets: list[dict],
    unit: str = "short",
    options: dict | None = None,
    overrides: list[dict] | None = None,
) -> dict:
    return {
        "type": kind,
        "title": title,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": overrides or []},
        "options": options or {},
    }


def right_axis(series_name: str, unit: str = "short") -> dict:
    """Field override: draw one series on a right-hand axis with its own unit."""
    return {
        "matcher": {"id": "byName", "options": series_name},
        "properties": [
            {"id": "unit", "value": unit},
            {"id": "custom.axisPlacement", "value": "right"},
        ],
    }


def stats() -> list[dict]:
    return [
        panel("stat", "Running", [q(f"sum(verifypd_num_requests_running{SEL})")]),
        panel("stat", "Waiting", [q(f"sum(verifypd_num_requests_waiting{SEL})")]),
        panel("stat", "KV cache usage", [q(f"max(verifypd_kv_cache_usage_ratio{SEL})")],
              "percentunit"),
        panel("stat", "Generated tokens/s",
              [q(f"sum(rate(verifypd_generation_tokens_total{SEL}[{RATE}]))")], "short"),
        panel("stat", "Draft acceptance",
              [q(ratio("verifypd_spec_accepted_tokens_total", "verifypd_spec_draft_tokens_total"))],
              "percentunit"),
        panel("stat", "Mean draft length", [q(mean("verifypd_controller_draft_length"))]),
    ]  # fmt: skip


def series() -> list[dict]:
    step = "verifypd_lane_step_seconds"
    return [
        panel("timeseries", "Lane queue depth",
              [q(f"sum by (lane) (verifypd_lane_queue_depth{SEL})", "{{lane}}")]),
        panel("timeseries", "Lane step latency (p50 / p95)",
              quantiles(step, "lane", (0.5, 0.95)), "s"),
        panel("timeseries", "Lane batch tokens (mean per step)",
              [q(mean("verifypd_lane_batch_tokens", "lane"), "{{lane}}")]),
        panel("timeseries", "Time to first token",
              quantiles("verifypd_time_to_first_token_seconds"), "s"),
        panel("timeseries", "Inter-token latency",
              quantiles("verifypd_inter_token_latency_seconds"), "s"),
        panel("timeseries", "End-to-end and queue time",
              quantiles("verifypd_e2e_request_latency_seconds", "", (0.5, 0.95))
              + [quantile("verifypd_request_queue_seconds", 0.95, legend="queue p95")], "s"),
        panel("timeseries", "Requests running / waiting",
              [q(f"sum(verifypd_num_requests_running{SEL})", "running"),
               q(f"sum(verifypd_num_requests_waiting{SEL})", "waiting")]),
        panel("timeseries", "KV cache",
              [q(f"max(verifypd_kv_cache_usage_ratio{SEL})", "usage"),
               q(f"sum(verifypd_kv_blocks_free{SEL})", "free blocks")], "percentunit",
              overrides=[right_axis("free blocks")]),
        panel("bargauge", "Controller draft length distribution (L chosen, range)",
              [{**q(f"sum by (le) (increase(verifypd_controller_draft_length_bucket{SEL}"
                    "[$__range]))", "{{le}}"), "format": "heatmap"}],
              options={"orientation": "vertical", "displayMode": "basic"}),
        panel("timeseries", "Speculation: acceptance rate and drafter temperature",
              [q(ratio("verifypd_spec_accepted_tokens_total", "verifypd_spec_draft_tokens_total"),
                 "acceptance"),
               q(f"max(verifypd_controller_drafter_temperature{SEL})", "drafter temperature")]),
        panel("timeseries", "Speculation policy decisions by reason (per second)",
              [q(f"sum by (decision) (rate(verifypd_spec_policy_decisions_total{SEL}[{RATE}]))",
                 "{{decision}}"),
               q(f"sum(rate(verifypd_spec_draft_misses_total{SEL}[{RATE}]))",
                 "lookups that found nothing")]),
        panel("timeseries", "Tokens per second",
              [q(f"sum(rate(verifypd_prompt_tokens_total{SEL}[{RATE}]))", "prompt"),
               q(f"sum(rate(verifypd_generation_tokens_total{SEL}[{RATE}]))", "generated"),
               q(f"sum(rate(verifypd_spec_draft_tokens_total{SEL}[{RATE}]))", "drafted"),
               q(f"sum(rate(verifypd_spec_drafter_prompt_tokens_total{SEL}[{RATE}]))",
                 "drafter fed behind prefill"),
               q(f"sum(rate(verifypd_decode_ahead_steps_total{SEL}[{RATE}]))",
                 "decode steps ahead"),
               q(f"sum(rate(verifypd_prompt_ahead_steps_total{SEL}[{RATE}]))",
                 "prompt steps ahead"),
               q(f"sum(rate(verifypd_prompts_in_decode_total{SEL}[{RATE}]))",
                 "prompts inside decode steps"),
               q(f"sum(rate(verifypd_decode_rows_fused_total{SEL}[{RATE}]))",
                 "decode rows inside prompt steps")]),
        panel("timeseries", "Requests finished by reason (per second)",
              [q(f"sum by (reason) (rate(verifypd_requests_finished_total{SEL}[{RATE}]))",
                 "{{reason}}")]),
        panel("timeseries", "Prefix cache hit rate, preemptions, compiles under traffic",
              [q(ratio("verifypd_prefix_cache_hits_total", "verifypd_prefix_cache_queries_total"),
                 "hit rate"),
               q(f"sum(rate(verifypd_preemptions_total{SEL}[{RATE}]))", "preemptions/s"),
               q(f"sum(increase(verifypd_kernel_compiles_total{SEL}[{RATE}]))",
                 "kernel compiles (each a stall)")]),
        panel("timeseries", "Server event loop: lag, GC pauses, policy decisions",
              quantiles("verifypd_event_loop_lag_seconds", "", (0.5, 0.99))
              + [quantile("verifypd_gc_pause_seconds", 0.99, "generation",
                          "gc gen {{generation}} p99"),
                 quantile("verifypd_spec_policy_decide_seconds", 0.99, "",
                          "speculation policy decision p99"),
                 quantile("verifypd_engine_loop_lag_seconds", 0.99, "",
                          "engine process loop lag p99 (--engine-process)")], "s"),
    ]  # fmt: skip


def layout(panels: list[dict], width: int, height: int, y0: int) -> int:
    """Assign gridPos and ids row by row (Grafana's grid is 24 units wide); returns next y."""
    per_row = 24 // width
    for i, p in enumerate(panels):
        p["gridPos"] = {"x": (i % per_row) * width, "y": y0 + (i // per_row) * height,
                        "w": width, "h": height}  # fmt: skip
    return y0 + -(-len(panels) // per_row) * height


def templating() -> dict:
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource",
                  "query": "prometheus", "current": {}, "hide": 0}  # fmt: skip
    model = {
        "name": "model", "label": "Model", "type": "query", "datasource": DS,
        "query": {"query": "label_values(verifypd_num_requests_running, model)", "refId": "m"},
        "definition": "label_values(verifypd_num_requests_running, model)",
        "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2,
        "hide": 0,
    }  # fmt: skip
    return {"list": [datasource, model]}


def dashboard() -> dict:
    top, rest = stats(), series()
    y = layout(top, 4, 4, 0)
    layout(rest, 8, 8, y)
    panels = top + rest
    for pid, p in enumerate(panels, start=1):
        p["id"] = pid
        for ref, target in zip("ABCDEFGH", p["targets"], strict=False):
            target["refId"] = ref
    return {
        "title": "verifypd",
        "uid": "verifypd-overview",
        "description": "verifypd lanes, controller, latency and KV cache (metric prefix verifypd_)",
        "tags": ["verifypd", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": templating(),
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
