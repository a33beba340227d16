"""Chat prompts for training a speculative head when the user gives none.

A head learns to predict what the served model says; what it needs is the model's
own answers to ordinary requests (explain, write, list, compare, advise), not any
particular dataset. These are made from templates and topics, so the set is large,
varied and reproducible without a download. The benchmark's held-out chats
(``bench/eagle_chats.txt``) share neither templates nor wording with these.
"""

from __future__ import annotations

import random

TEMPLATES = [
    "Explain {t} to a beginner.",
    "Write a short paragraph about {t}.",
    "What are the main benefits of {t}?",
    "Give me three tips related to {t}.",
    "Describe the history of {t} in a few sentences.",
    "Why do people care about {t}?",
    "Write a short poem about {t}.",
    "What are common mistakes people make with {t}?",
    "Summarize the key ideas behind {t}.",
    "How would you teach a child about {t}?",
    "List some interesting facts about {t}.",
    "What is the future of {t}?",
    "Write a friendly email to a colleague about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "What questions should I ask before getting into {t}?",
    "Tell me a short story that involves {t}.",
    "What are the risks of {t}?",
    "How can I get better at {t}?",
    "Give a simple definition of {t}.",
    "Write a product description for something related to {t}.",
]

TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the moon", "gardening", "cooking pasta",
    "baking bread", "running a marathon", "learning to swim", "playing chess", "learning a new language",
    "saving money", "personal budgeting", "public speaking", "time management", "writing a resume",
    "job interviews", "remote work", "team meetings", "electric cars", "solar energy", "wind turbines",
    "recycling", "climate change", "ocean pollution", "rainforests", "honey bees", "dolphins", "elephants",
    "cats", "dogs", "birds migrating", "the human heart", "sleep", "healthy eating", "drinking water",
    "yoga", "meditation", "stress", "friendship", "kindness", "volunteering", "libraries", "reading books",
    "writing poetry", "painting", "photography", "music lessons", "the piano", "the guitar", "jazz",
    "ancient Rome", "ancient Egypt", "the printing press", "the internet", "smartphones", "social media",
    "video games", "computer programming", "Python", "databases", "cybersecurity", "passwords",
    "artificial intelligence", "robots", "space travel", "Mars", "satellites", "weather forecasts",
    "earthquakes", "mountains", "deserts", "rivers", "islands", "travelling by train", "camping",
    "hiking", "cycling to work", "city parks", "public transport", "coffee", "tea", "chocolate",
    "vegetables", "fruit trees", "making friends at school", "homework", "exams", "teachers",
    "museums", "the Olympic games", "football", "basketball", "tennis", "board games", "puzzles",
    "magic tricks", "birthdays", "holidays", "moving to a new city", "buying a house", "renting an apartment",
]


def bundled_chat_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    """Every template x topic pair (2,060), shuffled reproducibly; the first ``count``."""
    prompts = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    random.Random(seed).shuffle(prompts)
    return prompts if count is None else prompts[:count]
