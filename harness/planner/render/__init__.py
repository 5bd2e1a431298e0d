"""A plan for people and programs: text.py writes it as text (what a person reads before renting hardware) and as
JSON (the same, as data); timing.py the step-time part (the fastest layouts, the first fit in the decision order
beside them, one evaluated layout)."""

from harness.planner.render.text import to_json, to_text

__all__ = ["to_json", "to_text"]
