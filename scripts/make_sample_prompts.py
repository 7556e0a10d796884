"""Regenerate batchjob/data/sample_prompts.parquet, the bundled prompts of the embedded default job.

Deterministic: the same file every time. Run: python scripts/make_sample_prompts.py
"""

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent.parent / "batchjob" / "data" / "sample_prompts.parquet"

TASKS = [
    "Summarise in one sentence: {text}",
    "Translate into French: {text}",
    "Write a short poem about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "List three facts about {topic}.",
    "What is the capital of {country}?",
    "Classify the sentiment of this review as positive or negative: {review}",
    "Write a haiku about {topic}.",
    "Give a one-line definition of {topic}.",
    "Continue the story: {text}",
    "Answer with a number: what is {a} plus {b}?",
    "Rewrite more formally: {text}",
    "Write a Python function that returns the {nth} Fibonacci number.",
    "Name a book about {topic} and say why it matters.",
    "Résumez en une phrase : {text}",
    "Fasse kurz zusammen: {text}",
]
TOPICS = [
    "photosynthesis",
    "black holes",
    "the French revolution",
    "tea",
    "gradient descent",
    "volcanoes",
    "the immune system",
    "jazz",
    "prime numbers",
    "glaciers",
    "the printing press",
    "honeybees",
    "quantum tunnelling",
    "sourdough bread",
    "plate tectonics",
    "the Silk Road",
    "compilers",
    "owls",
]
COUNTRIES = ["France", "Japan", "Kenya", "Peru", "Canada", "Norway", "India", "Chile", "Egypt", "Vietnam"]
TEXTS = [
    "The train was late again, and the platform filled with people holding coffee.",
    "Rain fell on the old city all night; by morning the river had risen to the bridge.",
    "She opened the letter slowly, knowing what it would say.",
    "The committee met on Tuesday and approved the new budget after a long debate.",
    "A small robot woke up in an empty warehouse and wondered where everyone had gone.",
    "Les enfants jouent dans le parc pendant que leurs parents discutent.",
    "Der Zug fährt um acht Uhr ab, aber niemand weiß, wann er ankommt.",
]
REVIEWS = [
    "Absolutely loved it, would buy again!",
    "Broke after two days. Waste of money.",
    "It's fine, nothing special.",
    "The best meal I've had this year 🍜",
    "Terrible service, cold food.",
]


def main() -> None:
    rng = random.Random(1234)
    rows = []
    for i in range(300):
        task = rng.choice(TASKS)
        prompt = task.format(
            text=rng.choice(TEXTS),
            topic=rng.choice(TOPICS),
            country=rng.choice(COUNTRIES),
            review=rng.choice(REVIEWS),
            a=rng.randint(1, 999),
            b=rng.randint(1, 999),
            nth=rng.randint(2, 40),
        )
        if rng.random() < 0.15:
            prompt = " ".join([prompt] * rng.randint(2, 5))
        rows.append({"id": f"sample-{i:04d}", "prompt": prompt, "topic": task.split()[0].lower()})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), OUT)
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
