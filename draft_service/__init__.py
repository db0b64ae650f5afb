"""The draft service: hosts small draft models and proposes γ tokens per step."""
