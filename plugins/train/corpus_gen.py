"""Generates the corpus ``dsplug train`` ships with (``data/corpus.txt``).

The text is a sequence of short folk-tale-like stories built from hand-written phrase lists
by a seeded :class:`random.Random`, so it is plain English with a small alphabet, it repeats
enough structure for a tiny character-level model to learn in a minute, and it is entirely
original (no copyright, no download). The shipped file is exactly::

    python -m dsplug.plugins.train.corpus_gen > plugins/train/data/corpus.txt

and a test regenerates it and compares byte for byte.
"""
from __future__ import annotations

import random
import sys
from typing import List, Tuple

SEED = 1859
TARGET_CHARS = 48_000

# (name, subject pronoun)
PEOPLE: List[Tuple[str, str]] = [
    ("miller", "he"), ("baker's daughter", "she"), ("old fisherman", "he"), ("young shepherd", "he"),
    ("weaver", "she"), ("blacksmith", "he"), ("widow", "she"), ("farmer's son", "he"), ("goose girl", "she"),
    ("tailor", "he"), ("carpenter", "he"), ("potter", "she"), ("ferryman", "he"), ("beekeeper", "she"),
    ("woodcutter", "he"), ("innkeeper", "she"), ("schoolmaster", "he"), ("herb woman", "she"),
    ("cobbler", "he"), ("lamplighter", "he"), ("queen's maid", "she"), ("charcoal burner", "he"),
]
ADJECTIVES = ["poor", "honest", "clever", "proud", "lazy", "kind", "foolish", "patient", "greedy", "humble",
              "quiet", "cheerful", "stubborn", "careful", "young", "old"]
OPENINGS = ["Once upon a time", "Long ago", "In the days when the king was young", "Many years ago",
            "In a certain country", "Not far from here, and not so long ago", "In the old days"]
HOMES = ["in a small house by the river", "at the edge of the great forest", "in a village under the hill",
         "in a cottage near the old mill", "beside the market square", "on a farm beyond the marsh",
         "in a narrow street of the town", "in a hut among the pines", "by the shore of a cold lake",
         "at the foot of the mountain", "in two rooms above the bakery", "on an island in the river"]
HABITS = ["{P} rose every morning before the sun.", "{P} worked from dawn until dark and never complained.",
          "{P} liked nothing better than a quiet evening by the fire.",
          "{P} had very little money, but a good heart.", "{P} talked to the birds as if they were neighbours.",
          "{P} kept a small garden of beans and cabbages.", "{P} could not pass a stranger without a word.",
          "{P} was always counting {poss} coins.", "Every Sunday {p} walked to the church on the hill.",
          "Nobody in the village could sing as well as {o}."]
WEATHER = ["The winter that year was long and hard.", "It was a dry summer, and the wells were low.",
           "The spring came late, and the fields were still brown.", "All autumn the wind blew from the north.",
           "That year the rain fell for forty days.", "The snow lay deep on the roads until March.",
           "It was the warmest summer anyone could remember."]
DAY_PARTS = ["morning", "evening", "afternoon", "night", "cold morning", "bright afternoon", "grey evening",
             "misty morning", "windy night"]
PLACES = ["well", "forest", "river", "market", "old bridge", "churchyard", "mill pond", "high meadow",
          "crossroads", "orchard", "stone wall", "ruined tower", "sea shore", "king's road"]
ERRANDS = ["fetch water", "gather wood", "sell eggs", "look for a lost goat", "pick apples", "catch fish",
           "buy bread", "find some quiet", "wash the linen", "dig for roots", "meet a friend"]
# (what the hero meets, what the story calls it afterwards, its pronoun)
STRANGERS: List[Tuple[str, str, str]] = [
    ("a grey heron", "heron", "it"), ("a talking fox", "fox", "it"),
    ("a little old man with a long beard", "old man", "he"), ("a white hare", "hare", "it"),
    ("a crow with one eye", "crow", "it"), ("a golden fish", "fish", "it"), ("a tired horse", "horse", "it"),
    ("a stranger in a green coat", "stranger", "he"), ("a small brown mouse", "mouse", "it"), ("an owl", "owl", "it"),
    ("a lost child", "child", "she"), ("a wolf", "wolf", "it"), ("a beggar woman", "beggar woman", "she"),
    ("a black cat", "cat", "it"), ("a giant asleep under a tree", "giant", "he"),
]
MEETS = ["met", "found", "saw", "came upon", "noticed"]
GREETINGS = ["Good day to you", "Wait a moment", "Please, help me", "Do not be afraid", "Listen to me",
             "Well met, friend", "Stop, traveller", "Have pity on me"]
REQUESTS = ["I have lost my way, and I cannot find it again.",
            "If you give me your bread, I will give you good advice.",
            "Carry me across the water, and you will not be sorry.",
            "Set me free, and I will grant you one wish.",
            "Tell me where the wind comes from, and I will tell you a secret.",
            "I am hungry and cold; share your fire with me tonight.",
            "Find my golden ring, and I will make you rich.",
            "Do not tell anyone that you have seen me here."]
REPLIES = ["Very well", "Why should I?", "I have nothing to give", "Gladly", "That is a strange thing to ask",
           "I will do what I can", "You must be joking", "Let me think about it"]
ACTS = ["shared what little {p} had", "laughed and walked away", "did as the {thing} asked",
        "asked for something in return", "ran home as fast as {p} could", "sat down and listened",
        "took off {poss} coat and gave it away", "promised to come back the next day"]
REACTIONS = ["{P} thought for a while, and then {p} {act}.", "{P} did not answer at once, but at last {p} {act}.",
             "Without another word, the {who} {act}.", "So the {who} {act}."]
OUTCOMES = ["When {p} came home, {p} found a bag of silver on the table.",
            "From that day on, the {thing} came to visit every {day_part}.",
            "But the next morning the {thing} was gone, and nobody ever saw {to} again.",
            "The neighbours laughed at {o}, but the {who} did not mind.",
            "After that, the {who} never went to the {place} again.",
            "Years later, when {p} was old, {p} still told the story to anyone who would listen.",
            "That winter {poss} house was the only warm house in the village.",
            "And the {thing} kept {tposs} word, as the old stories say."]
MORALS = ["And so it is said that a kind word costs nothing.",
          "And that is why the old people say: listen before you speak.", "So it goes: the greedy lose twice.",
          "Patience, as they say, is better than gold.", "And if they have not died, they are living there still.",
          "Whoever does not believe it may go and see for himself.", "That is all; the story is told."]

_PRONOUNS = {"he": {"p": "he", "P": "He", "poss": "his", "o": "him"},
             "she": {"p": "she", "P": "She", "poss": "her", "o": "her"},
             "it": {"p": "it", "P": "It", "poss": "its", "o": "it"}}


def _title(words: str) -> str:
    return " ".join(w[:1].upper() + w[1:] for w in words.split())


def _reply(text: str, who: str) -> str:
    if text.endswith("?"):
        return f"\"{text}\" asked the {who}."
    return f"\"{text},\" said the {who}."


def story(rng: random.Random) -> str:
    """One story: a title line and three paragraphs."""
    who, pronoun = rng.choice(PEOPLE)
    adjective = rng.choice(ADJECTIVES)
    met, thing, its = rng.choice(STRANGERS)
    words = dict(_PRONOUNS[pronoun], who=who, thing=thing, to=_PRONOUNS[its]["o"], tposs=_PRONOUNS[its]["poss"],
                 day_part=rng.choice(DAY_PARTS), place=rng.choice(PLACES))
    article = "an" if adjective[0] in "aeiou" else "a"
    act = rng.choice(ACTS).format(**words)
    setting = " ".join([
        f"{rng.choice(OPENINGS)}, there was {article} {adjective} {who} who lived {rng.choice(HOMES)}.",
        rng.choice(HABITS).format(**words),
        rng.choice(WEATHER),
    ])
    event = " ".join([
        f"One {words['day_part']}, the {who} went to the {words['place']} to {rng.choice(ERRANDS)}.",
        f"There {words['p']} {rng.choice(MEETS)} {met}.",
        f"\"{rng.choice(GREETINGS)},\" said the {thing}. \"{rng.choice(REQUESTS)}\"",
        _reply(rng.choice(REPLIES), who),
    ])
    ending = " ".join([
        rng.choice(REACTIONS).format(act=act, **words),
        rng.choice(OUTCOMES).format(**words),
        rng.choice(MORALS),
    ])
    return f"The {_title(adjective)} {_title(who)} and the {_title(thing)}\n\n{setting}\n\n{event}\n\n{ending}\n"


def generate(seed: int = SEED, target_chars: int = TARGET_CHARS) -> str:
    """Whole stories until the text is at least ``target_chars`` long."""
    rng = random.Random(seed)
    stories: List[str] = []
    length = 0
    while length < target_chars:
        stories.append(story(rng))
        length += len(stories[-1]) + 1
    return "\n".join(stories)


if __name__ == "__main__":
    sys.stdout.write(generate())
