"""Real-language prompts with checkable answers for the real pair (``distillq demo --real``).

Short factual and word questions a 135M-parameter instruction model answers well (capitals, opposites, plurals,
past tenses, days and months, colours, animal sounds), written here from word lists, never downloaded.
``generate()`` writes them; the package ships the result as ``real_tasks.jsonl`` (one JSON object a line:
``id``, ``split``, ``messages``, ``answer``, ``accept``), with about one in five held out by a hash of its id.

The task metric is accuracy: a greedy completion is right when one of ``accept`` appears in it as a whole word
(case-insensitive).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from importlib.resources import files
from typing import Any

from pipeline.models.prune import PromptItem, Prompts

DATA_FILE = "real_tasks.jsonl"
HELDOUT_ONE_IN = 5

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "the United Kingdom": "London", "England": "London",
    "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen", "Austria": "Vienna",
    "Poland": "Warsaw", "Hungary": "Budapest", "the Czech Republic": "Prague", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Thailand": "Bangkok", "South Korea": "Seoul", "India": "New Delhi",
    "Kenya": "Nairobi", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago", "Mexico": "Mexico City",
    "Cuba": "Havana", "Iran": "Tehran", "Iraq": "Baghdad", "Turkey": "Ankara", "Ukraine": "Kyiv",
    "Canada": "Ottawa", "Australia": "Canberra", "the United States": "Washington", "Indonesia": "Jakarta",
    "Vietnam": "Hanoi", "the Philippines": "Manila", "Colombia": "Bogota", "Venezuela": "Caracas",
    "Switzerland": "Bern", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Saudi Arabia": "Riyadh", "Afghanistan": "Kabul", "Pakistan": "Islamabad", "Nigeria": "Abuja",
    "Ethiopia": "Addis Ababa", "Morocco": "Rabat", "Brazil": "Brasilia", "Iceland": "Reykjavik",
    "Scotland": "Edinburgh", "Wales": "Cardiff", "Jordan": "Amman", "Lebanon": "Beirut", "Syria": "Damascus",
    "Qatar": "Doha", "Nepal": "Kathmandu", "Bangladesh": "Dhaka", "Malaysia": "Kuala Lumpur",
    "New Zealand": "Wellington", "Ghana": "Accra", "Senegal": "Dakar", "Uganda": "Kampala", "Algeria": "Algiers",
    "Tunisia": "Tunis", "Libya": "Tripoli", "Sudan": "Khartoum", "Ecuador": "Quito", "Uruguay": "Montevideo",
    "Paraguay": "Asuncion", "Jamaica": "Kingston", "Panama": "Panama City", "Croatia": "Zagreb",
    "Slovakia": "Bratislava", "Slovenia": "Ljubljana", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius",
    "Belarus": "Minsk", "Armenia": "Yerevan", "Mongolia": "Ulaanbaatar", "North Korea": "Pyongyang",
    "Taiwan": "Taipei", "Albania": "Tirana", "Cyprus": "Nicosia", "Malta": "Valletta", "Zimbabwe": "Harare",
    "Angola": "Luanda", "Somalia": "Mogadishu", "Kuwait": "Kuwait City", "Oman": "Muscat", "Yemen": "Sanaa",
    "Cambodia": "Phnom Penh", "Laos": "Vientiane",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad", "light": "dark",
    "open": "closed", "old": "young", "rich": "poor", "strong": "weak", "tall": "short", "wet": "dry",
    "hard": "soft", "early": "late", "full": "empty", "good": "bad", "high": "low", "in": "out", "left": "right",
    "love": "hate", "loud": "quiet", "near": "far", "new": "old", "night": "day", "true": "false", "win": "lose",
    "yes": "no", "black": "white", "thick": "thin", "clean": "dirty", "cheap": "expensive", "heavy": "light",
    "inside": "outside", "push": "pull", "start": "finish", "buy": "sell", "alive": "dead", "first": "last",
    "above": "below", "before": "after", "give": "take", "top": "bottom", "front": "back", "north": "south",
    "east": "west", "summer": "winter", "boy": "girl", "man": "woman", "king": "queen", "friend": "enemy",
    "cold": "hot", "small": "big", "slow": "fast", "sad": "happy", "dark": "light", "dry": "wet", "soft": "hard",
    "empty": "full", "bad": "good", "low": "high", "down": "up", "wrong": "right", "false": "true", "awake": "asleep",
    "smooth": "rough", "sweet": "sour", "wide": "narrow", "deep": "shallow", "laugh": "cry", "always": "never",
    "everything": "nothing", "question": "answer", "remember": "forget", "increase": "decrease",
    "maximum": "minimum", "under": "over", "safe": "dangerous", "possible": "impossible", "visible": "invisible",
    "polite": "rude", "ancient": "modern", "sunrise": "sunset", "entrance": "exit", "floor": "ceiling",
    "odd": "even", "winter": "summer", "south": "north", "west": "east", "day": "night", "girl": "boy",
    "queen": "king", "enemy": "friend", "poor": "rich", "weak": "strong", "dead": "alive", "last": "first",
}
PLURALS = {
    "child": "children", "mouse": "mice", "man": "men", "woman": "women", "foot": "feet", "tooth": "teeth",
    "goose": "geese", "person": "people", "cat": "cats", "dog": "dogs", "box": "boxes", "bus": "buses",
    "city": "cities", "baby": "babies", "knife": "knives", "leaf": "leaves", "wolf": "wolves", "book": "books",
    "apple": "apples", "car": "cars", "house": "houses", "tree": "trees", "church": "churches", "dish": "dishes",
    "party": "parties", "story": "stories", "potato": "potatoes", "hero": "heroes", "sheep": "sheep",
    "fish": "fish", "ox": "oxen", "wife": "wives", "life": "lives", "half": "halves", "bird": "birds",
    "girl": "girls", "boy": "boys", "day": "days", "key": "keys", "toy": "toys",
    "horse": "horses", "cow": "cows", "pen": "pens", "cup": "cups", "hat": "hats", "bag": "bags", "chair": "chairs",
    "table": "tables", "flower": "flowers", "river": "rivers", "star": "stars", "shoe": "shoes", "glass": "glasses",
    "class": "classes", "kiss": "kisses", "watch": "watches", "fox": "foxes", "wish": "wishes", "brush": "brushes",
    "lady": "ladies", "country": "countries", "family": "families", "cherry": "cherries", "puppy": "puppies",
    "monkey": "monkeys", "tomato": "tomatoes", "echo": "echoes", "piano": "pianos", "photo": "photos", "zoo": "zoos",
    "shelf": "shelves", "loaf": "loaves", "thief": "thieves", "calf": "calves", "deer": "deer", "friend": "friends",
    "egg": "eggs", "window": "windows", "door": "doors", "ball": "balls", "bed": "beds", "pencil": "pencils",
}
PAST = {
    "go": "went", "eat": "ate", "see": "saw", "run": "ran", "swim": "swam", "write": "wrote", "take": "took",
    "give": "gave", "come": "came", "sing": "sang", "drink": "drank", "buy": "bought", "bring": "brought",
    "think": "thought", "teach": "taught", "catch": "caught", "fly": "flew", "drive": "drove", "speak": "spoke",
    "break": "broke", "choose": "chose", "forget": "forgot", "get": "got", "make": "made", "say": "said",
    "tell": "told", "sell": "sold", "find": "found", "stand": "stood", "sit": "sat", "sleep": "slept",
    "keep": "kept", "leave": "left", "feel": "felt", "meet": "met", "pay": "paid", "win": "won", "begin": "began",
    "walk": "walked", "play": "played", "jump": "jumped", "talk": "talked", "cook": "cooked", "dance": "danced",
    "ride": "rode", "rise": "rose", "wake": "woke", "wear": "wore", "tear": "tore", "steal": "stole",
    "freeze": "froze", "hide": "hid", "bite": "bit", "blow": "blew", "grow": "grew", "know": "knew",
    "throw": "threw", "draw": "drew", "fall": "fell", "hold": "held", "hear": "heard", "lose": "lost", "send": "sent",
    "spend": "spent", "build": "built", "lend": "lent", "bend": "bent", "feed": "fed", "lead": "led",
    "fight": "fought", "ring": "rang", "shake": "shook", "forgive": "forgave", "understand": "understood",
    "become": "became", "dig": "dug", "hang": "hung", "shoot": "shot", "sting": "stung", "swing": "swung",
    "mean": "meant", "sweep": "swept", "weep": "wept", "do": "did", "have": "had", "open": "opened",
    "close": "closed", "laugh": "laughed", "cry": "cried", "carry": "carried", "stop": "stopped", "want": "wanted",
    "help": "helped", "look": "looked", "smile": "smiled", "live": "lived", "try": "tried", "study": "studied",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
COLOURS = {
    "a banana": "yellow", "grass": "green", "the sky on a clear day": "blue", "snow": "white", "coal": "black",
    "a ripe tomato": "red", "an orange": "orange", "milk": "white", "a lemon": "yellow", "a strawberry": "red",
    "a carrot": "orange", "a leaf in summer": "green", "the sea": "blue", "blood": "red", "chocolate": "brown",
    "a polar bear": "white", "a crow": "black", "a fire truck": "red", "a lime": "green", "the sun": "yellow",
    "a cucumber": "green", "an eggplant": "purple", "a pumpkin": "orange", "a flamingo": "pink", "a raven": "black",
    "a cherry": "red", "a ruby": "red", "an emerald": "green", "a sapphire": "blue", "a blueberry": "blue",
    "ivory": "white", "charcoal": "black", "a canary": "yellow", "butter": "yellow", "a school bus": "yellow",
    "a stop sign": "red", "a swan": "white", "an elephant": "grey", "a panther": "black", "broccoli": "green",
    "cinnamon": "brown", "coffee": "brown", "a pea": "green", "a plum": "purple", "sugar": "white", "salt": "white",
    "the night sky": "black", "a koala": "grey", "a pine tree": "green", "a sunflower": "yellow",
    "an avocado": "green", "a cloud": "white", "a fox": "orange", "a lavender flower": "purple", "a pig": "pink",
}
SOUNDS = {
    "a cow": "moo", "a dog": "woof", "a cat": "meow", "a duck": "quack", "a sheep": "baa", "a lion": "roar",
    "a snake": "hiss", "a bee": "buzz", "an owl": "hoot", "a pig": "oink", "a horse": "neigh", "a frog": "croak",
    "a chicken": "cluck", "a mouse": "squeak", "a wolf": "howl", "a donkey": "hee-haw", "a goat": "baa",
    "a turkey": "gobble", "an elephant": "trumpet", "a crow": "caw", "a dove": "coo", "a bear": "growl",
    "a bird": "tweet", "a cricket": "chirp", "a mosquito": "buzz", "a tiger": "roar", "a chick": "cheep",
    "a rooster": "cock-a-doodle-doo",
}
ALSO = {"Washington": ["Washington, D.C."], "Kyiv": ["Kiev"], "Bogota": ["Bogotá"], "Brasilia": ["Brasília"],
        "woof": ["bark", "barks"], "meow": ["purr"], "finish": ["end", "stop"], "closed": ["shut", "close"],
        "quiet": ["soft", "silent"], "short": ["small"], "take": ["receive"], "lose": ["loss"],
        "late": ["later"], "dead": ["died"], "hate": ["hatred"], "baa": ["bleat"], "neigh": ["whinny"],
        "Asuncion": ["Asunción"], "Sanaa": ["Sana'a"], "Ulaanbaatar": ["Ulan Bator"], "grey": ["gray"],
        "hee-haw": ["bray"], "cluck": ["cackle"], "tweet": ["chirp", "sing"], "cheep": ["peep", "chirp"],
        "growl": ["roar"], "big": ["large"], "asleep": ["sleeping"], "rough": ["coarse"],
        "over": ["above"], "dangerous": ["unsafe"], "rude": ["impolite"], "modern": ["new"]}


def _items() -> Iterator[tuple[str, str, str]]:
    """(kind, question, answer) for every prompt."""
    for country, city in CAPITALS.items():
        yield "capital", f"What is the capital of {country}?", city
    for word, opp in OPPOSITES.items():
        yield "opposite", f"What is the opposite of the word \"{word}\"? Answer with one word.", opp
    for word, plural in PLURALS.items():
        yield "plural", f"What is the plural of \"{word}\"?", plural
    for verb, past in PAST.items():
        yield "past", f"What is the past tense of the verb \"{verb}\"?", past
    for i, day in enumerate(DAYS):
        yield "day", f"Which day of the week comes after {day}?", DAYS[(i + 1) % 7]
        yield "day", f"Which day of the week comes before {day}?", DAYS[(i - 1) % 7]
    for i, month in enumerate(MONTHS):
        yield "month", f"Which month comes after {month}?", MONTHS[(i + 1) % 12]
        yield "month", f"Which month comes before {month}?", MONTHS[(i - 1) % 12]
    for thing, colour in COLOURS.items():
        yield "colour", f"What colour is {thing}? Answer with one word.", colour
    for animal, sound in SOUNDS.items():
        yield "sound", f"What sound does {animal} make?", sound


def is_heldout(prompt_id: str) -> bool:
    return int(hashlib.sha256(prompt_id.encode()).hexdigest(), 16) % HELDOUT_ONE_IN == 0


def generate() -> list[dict[str, Any]]:
    """Every prompt, in a fixed order, with its split."""
    out = []
    for n, (kind, question, answer) in enumerate(_items()):
        pid = f"{kind}-{n:03d}"
        out.append({"id": pid, "split": "heldout" if is_heldout(pid) else "train",
                    "messages": [{"role": "user", "content": question}], "answer": answer,
                    "accept": [answer, *ALSO.get(answer, [])]})
    return out


def load(split: str | None = None) -> list[dict[str, Any]]:
    """The packaged prompts (``split``: ``"train"``, ``"heldout"`` or None for all)."""
    text = files("pipeline.demo").joinpath(DATA_FILE).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]


def is_correct(completion: str, accept: Sequence[str]) -> bool:
    """True when one of ``accept`` occurs in ``completion`` as a whole word or phrase (case-insensitive)."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", completion, re.IGNORECASE) for a in accept)


def write(path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in generate():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


TRAIN_PROMPTS_SOURCE = "pipeline/demo/real_tasks.jsonl (train split)"


def train_prompts() -> Prompts:
    """The train split's chat messages, as ``pipeline.models.prune`` measures on (hash: of the packaged file)."""
    data = files("pipeline.demo").joinpath(DATA_FILE).read_bytes()
    items: list[PromptItem] = [r["messages"] for r in load("train")]
    return Prompts(items, TRAIN_PROMPTS_SOURCE, hashlib.sha256(data).hexdigest())


if __name__ == "__main__":
    import sys

    write(sys.argv[1] if len(sys.argv) > 1 else str(files("pipeline.demo").joinpath(DATA_FILE)))
