"""Prompts for tests: MT-Bench questions from ``../shared/data`` when it is there, else the
project's own questions below (a user's clone has no ``../shared``; the tests must pass on
it, only with these prompts instead).

``JAXINFER_TEST_DATA_DIR`` points the tests at another data directory; set it to a path
that does not exist to run them as a plain clone would (.ci/run does, for the tests
that read data).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Written for these tests (not MT-Bench): varied lengths, topics, scripts and formats.
BUILTIN_QUESTIONS = [
    "What is the capital of France, and why did it become the capital?",
    "Explain what a prime number is to a ten-year-old.",
    "Write a haiku about autumn rain on a tin roof.",
    "Give me three tips for writing clean Python code.",
    "Summarize the plot of a heist movie in two sentences, without naming any film.",
    "How does a hash table handle collisions? Compare chaining and open addressing.",
    "Translate 'Where is the train station?' into Spanish, German and Japanese.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "What are the pros and cons of remote work for a small startup?",
    "Describe the water cycle in four steps.",
    "Draft a polite email declining a meeting invitation because of a schedule conflict.",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "Why is the sky blue? Keep the answer under 100 words.",
    "List five common mistakes beginners make when learning to cook, and how to avoid them.",
    "Write a short dialogue between a lighthouse keeper and a lost seagull.",
    "What is the difference between a process and a thread?",
    "Écris un court poème sur la mer et le vent.",
    "用一句话解释什么是机器学习。",
    "Erkläre kurz, wie eine Wärmepumpe funktioniert.",
    "¿Cuáles son los beneficios de caminar todos los días?",
    "Compose a limerick about a cat who learned to code in Rust.",
    "Explain recursion with an example in JavaScript.",
    "Plan a three-day itinerary for a first visit to Kyoto on a modest budget.",
    "What causes inflation, and what tools do central banks use against it?",
    "Rewrite this sentence in the passive voice: 'The committee approved the new budget.'",
    "Give a step-by-step recipe for a vegetarian lentil soup.",
    "What would happen to Earth's climate if the Moon disappeared?",
    "Write a product description for a solar-powered backpack, in an upbeat tone.",
    "Explain the Monty Hall problem and why switching doors is better.",
    "Create a JSON object describing a book with title, author, year and three tags.",
    "How do vaccines train the immune system?",
    "Suggest names for a coffee shop that also repairs bicycles.",
    "Write a bash one-liner that counts the lines of every .py file under a directory.",
    "Compare the French and American revolutions in a short paragraph.",
    "What is gradient descent? Include the update rule.",
    "Tell a two-paragraph story that begins with 'The clock struck thirteen.'",
    "Explain the difference between 'affect' and 'effect' with examples.",
    "How would you design a URL shortener that handles a million requests per day?",
    "Give me a 20-minute bodyweight workout for a beginner.",
    "Write a regular expression that matches ISO 8601 dates like 2024-03-15.",
    "Why do onions make people cry, and how can it be prevented?",
    "Describe a sunset over the desert using all five senses.",
    "What are the main differences between TCP and UDP?",
    "Summarize the rules of chess for someone who has never played.",
    "Write a thank-you note to a teacher who inspired you.",
    "Estimate how many piano tuners work in a city of two million people. Explain your reasoning.",
    "What is the time complexity of binary search, and why?",
    "Invent a board game for four players and explain its rules briefly.",
]


def data_dir() -> Path:
    """``$JAXINFER_TEST_DATA_DIR``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("JAXINFER_TEST_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def mt_bench_turns(directory: Path | None = None) -> list[str] | None:
    """Every turn of every MT-Bench question in ``directory`` (default ``data_dir()``), or
    None when the file is not there."""
    path = (directory if directory is not None else data_dir()) / "mt_bench_questions.jsonl"
    if not path.is_file():
        return None
    return [t for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            for t in json.loads(line)["turns"]]


def questions(directory: Path | None = None) -> list[str]:
    """MT-Bench's first turns when the data is there, else ``BUILTIN_QUESTIONS``."""
    path = (directory if directory is not None else data_dir()) / "mt_bench_questions.jsonl"
    if not path.is_file():
        return list(BUILTIN_QUESTIONS)
    return [json.loads(line)["turns"][0] for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
