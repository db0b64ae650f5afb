"""The rule-based task classifier, measured on a small labelled set."""
from __future__ import annotations

from gateway.tasks import classify

LABELLED = [
    ("def parse_header(line):", "code"),
    ("import os\nimport sys\n\ndef main():", "code"),
    ("class LRUCache:\n    def __init__(self, size):", "code"),
    ("for item in items:\n    total +=", "code"),
    ("function add(a, b) {", "code"),
    ("What is the capital of France?", "qa"),
    ("How does a hash map handle collisions?", "qa"),
    ("Why is the sky blue?", "qa"),
    ("Who wrote The Old Man and the Sea?", "qa"),
    ("Summarize the following article in two sentences: The city council met on Tuesday", "summarization"),
    ("TL;DR of this thread: people argued about tabs and spaces", "summarization"),
    ("Give me a summary of the meeting notes below.", "summarization"),
    ("Translate into French: The weather is nice today.", "translation"),
    ("Translate the following sentence to German: good morning", "translation"),
    ("Please translate 'thank you very much' into Spanish", "translation"),
    ("Plan the steps to migrate the database, then choose a tool for each step.", "agentic"),
    ("You are an agent. Thought: I need the weather. Action:", "agentic"),
    ("Break this down into subtasks and pick the next action.", "agentic"),
    ("The history of the Roman empire begins", "general"),
    ("Once upon a time in a small village,", "general"),
    ("The module provides functions for working with dates and times.", "general"),
    ("Dear team, thank you all for a wonderful year.", "general"),
]


def test_classifier_accuracy_on_labelled_prompts():
    wrong = [(p, want, classify(p)) for p, want in LABELLED if classify(p) != want]
    accuracy = 1 - len(wrong) / len(LABELLED)
    assert accuracy >= 0.9, wrong


def test_every_label_is_reachable():
    assert {classify(p) for p, _ in LABELLED} == {"code", "qa", "summarization", "translation", "agentic", "general"}
