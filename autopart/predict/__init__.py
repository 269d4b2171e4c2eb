"""Figures predicted for a plan: its step time, its memory, its schedule's timeline."""
