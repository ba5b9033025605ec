"""What ``make run`` prints of the router's ``/admin/kv-index/stats`` document."""

from __future__ import annotations

from bench.demo import capped_rate, kv_split, prompt_kinds


def test_the_demo_reads_the_conversation_scorers_figures_from_the_admin_document() -> None:
    doc = {
        "enabled": True,
        "routing_decisions": {"kv_aware": 700, "fallback": 100},
        "conversation": {
            "routing_decisions": {
                "chosen": 600,
                "tie": 150,
                "none_held": 50,
                "total": 800,
                "capped": 20,
            },
            "prompts": {"tracked": 24, "one_shot": 1, "small_turns": 22},
        },
    }
    assert capped_rate(doc) == "0.0250"
    assert kv_split(doc) == "700/100"
    kinds = prompt_kinds(doc)
    assert kinds is not None and kinds.startswith(
        "24 prompts seen, 22 of small turns and 1 one-shot"
    )


def test_a_router_without_the_conversation_index_shows_dashes() -> None:
    assert capped_rate({"enabled": False}) == "-" and kv_split({"enabled": False}) == "-"
    assert prompt_kinds({"enabled": False}) is None
