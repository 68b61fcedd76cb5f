"""Example agents, written only against the OpenAI-style client of ``areal_mega.workflows.agent``."""
