"""The draft's training prompts: a topic x task grid of everyday requests, plus code.

A chat model is asked everything, so the draft is trained on the target's answers to prompts of
many kinds (`KINDS`), built from the lists below with a seeded generator: no hub, no dataset, no
model writes them. Two rounds (`blockspec.models.train_draft --stage generate`):

* round 1, single-turn requests: questions, explanations, how-tos, creative and practical
  writing, lists and comparisons, advice, maths word problems, code in several languages, and
  rewrites / summaries of prose that ships with Python (module docstrings);
* round 2, built from round 1's answers (self-instruct: the target writes the text): follow-up
  turns of a conversation, and summaries / rewrites of the target's own answers.

None of the topics of the held-out set (`loadtest.everyday.HELD_OUT_TOPICS`) appear here
(`assert_disjoint`, checked by tests/test_draft_prompts.py).
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from pathlib import Path

from blockspec.loadtest.everyday import HELD_OUT_TOPICS
from blockspec.loadtest.prompts import complete_function

Turns = list[dict[str, str]]

TOPICS = (
    # science and nature
    "gravity", "magnetism", "photosynthesis", "DNA", "black holes", "the water cycle",
    "earthquakes", "climate change", "the immune system", "electricity", "atoms",
    "the speed of light", "evolution", "the solar system", "the human heart", "sleep",
    "dinosaurs", "the ozone layer", "sound waves", "friction", "rain forests", "deserts",
    "the moon", "comets", "bacteria", "viruses", "the brain", "muscles", "bones",
    "recycling", "nuclear energy", "wind turbines", "batteries", "magnets", "clouds",
    "snowflakes", "hurricanes", "rivers", "mountains", "caves", "whales", "elephants",
    "ants", "butterflies", "owls", "sharks", "dolphins", "wolves", "cats", "dogs", "horses",
    "trees", "cactus plants", "the seasons", "the periodic table", "acids and bases",
    "the Big Bang", "Mars", "Jupiter", "stars", "eclipses", "genetics", "vitamins",
    # history and society
    "ancient Egypt", "the Renaissance", "the Industrial Revolution", "the Vikings",
    "the Silk Road", "the Great Wall of China", "democracy", "the United Nations",
    "the Olympic Games", "the invention of the telephone", "the first airplane flight",
    "the moon landing", "the French Revolution", "castles", "pirates", "samurai",
    "ancient Greece", "the Aztecs", "the Cold War", "money", "taxes", "inflation",
    "elections", "human rights", "the internet", "social media", "newspapers",
    # everyday life
    "cooking pasta", "baking cookies", "making coffee", "tea", "breakfast", "vegetarian food",
    "meal planning", "budgeting", "saving money", "renting an apartment", "moving house",
    "job interviews", "public speaking", "time management", "studying for exams",
    "learning a language", "making friends", "gardening", "house plants", "composting",
    "cleaning the kitchen", "doing laundry", "camping", "hiking", "road trips",
    "travelling on a budget", "packing a suitcase", "birthday parties", "weddings",
    "pets", "adopting a cat", "walking a dog", "raising children", "homework",
    "remote work", "online shopping", "car maintenance", "driving in snow", "first aid",
    "staying hydrated", "stress", "meditation", "running", "swimming", "yoga", "football",
    "basketball", "tennis", "cycling through a city", "skiing", "fishing", "photography",
    "painting", "drawing", "knitting", "playing the guitar", "the piano", "singing",
    "writing a diary", "reading habits", "podcasts", "video games", "board games", "movies",
    # technology and work
    "artificial intelligence", "machine learning", "smartphones", "passwords",
    "cybersecurity", "cloud computing", "3D printing", "electric cars", "robots",
    "virtual reality", "spreadsheets", "email etiquette", "databases", "open source software",
    "programming", "web browsers", "Wi-Fi", "GPS", "satellites", "drones", "cryptocurrency",
    "starting a small business", "marketing", "customer service", "teamwork", "leadership",
    "negotiation", "writing a resume", "project deadlines", "meetings", "productivity apps",
)  # fmt: skip

ACTIVITIES = (
    "boil an egg perfectly", "change a flat tyre", "write a good resume", "start running",
    "fall asleep faster", "save for a holiday", "learn to juggle", "plant tomatoes",
    "make a budget spreadsheet", "remove a coffee stain", "prepare for a job interview",
    "write a cover letter", "set up a home network", "back up my photos",
    "learn to touch type", "make pancakes", "organise my closet", "clean a laptop keyboard",
    "make new friends in a new city", "train a puppy to sit", "meditate for the first time",
    "write a short speech", "improve my handwriting", "cook rice on the stove",
    "make a paper airplane", "keep house plants alive", "reduce my screen time",
    "memorise a poem", "start a podcast", "paint a room", "sharpen a kitchen knife",
    "stop procrastinating", "learn to swim as an adult", "plan a birthday party",
    "make a smoothie", "build a birdhouse", "study for a maths test", "take better photos",
    "write a thank-you letter", "learn chords on a guitar", "negotiate a higher salary",
    "fix a leaking tap", "make homemade pizza dough", "grow herbs on a windowsill",
    "pack light for a week-long trip", "care for a goldfish", "start journaling",
    "teach a child to tie shoelaces", "wash a wool sweater", "set goals for the new year",
    "host a dinner party", "learn a new language quickly", "stay focused while studying",
    "write a blog post", "choose a good laptop", "make cold brew coffee", "start composting",
)  # fmt: skip

CHARACTERS = (
    "a young wizard", "a robot", "a grumpy cat", "an old sailor", "a lonely dragon",
    "a clever fox", "a shy giraffe", "a time traveller", "a detective", "a baker",
    "a little mouse", "an astronaut", "a forgetful king", "a talking tree", "a pirate captain",
    "a girl who can fly", "a snowman", "a ghost", "a knight", "a school teacher",
)  # fmt: skip

SITUATIONS = (
    "loses something important", "finds a secret door", "learns to be brave",
    "makes an unlikely friend", "goes on a long journey", "has one day to save the town",
    "wakes up in a different century", "discovers a hidden talent", "tries to keep a secret",
    "enters a cooking contest", "gets lost in a big city", "builds a machine",
)  # fmt: skip

FORMS = (
    "haiku", "short poem", "limerick", "short story", "fable", "song verse", "sonnet",
    "riddle", "diary entry", "funny dialogue between two friends", "motivational quote",
    "children's rhyme",
)  # fmt: skip

RECIPIENTS = (
    "my manager", "a customer", "my landlord", "a teacher", "a colleague", "my team",
    "a hotel", "a friend", "my doctor's office", "a new client", "the school principal",
)  # fmt: skip

MATTERS = (
    "asking for a day off", "a late delivery", "a broken heater", "rescheduling a meeting",
    "thanking them for their help", "a project update", "a refund request",
    "an invitation to a party", "a complaint about noise", "introducing myself",
    "following up after an interview", "a change of address",
)  # fmt: skip

PRODUCTS = (
    "a reusable water bottle", "noise-cancelling headphones", "a standing desk",
    "a handmade candle", "a smart watch", "a camping tent", "an electric toothbrush",
    "a coffee grinder", "a children's book", "a yoga mat", "a backpack", "a desk lamp",
)  # fmt: skip

LANGUAGES = (
    "Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby",
    "bash", "SQL", "PHP", "Kotlin", "Swift", "C#",
)  # fmt: skip

CODE_TASKS = (
    "reverses a string", "checks if a number is prime", "counts the words in a sentence",
    "finds the largest number in a list", "removes duplicates from a list",
    "computes the factorial of a number", "checks if a word is a palindrome",
    "sorts a list of names alphabetically", "reads a text file and prints each line",
    "converts kilometres to miles", "returns the Fibonacci numbers up to n",
    "merges two sorted arrays", "validates an email address", "counts vowels in a string",
    "computes the average of a list", "finds the second smallest element",
    "checks whether two strings are anagrams", "flattens a nested list",
    "implements binary search", "parses a date string", "capitalises every word",
    "sums the digits of a number", "generates a random password", "implements a stack",
    "implements a queue", "finds the most common element", "rotates an array by k",
    "converts a number to binary", "checks if a year is a leap year", "transposes a matrix",
)  # fmt: skip

CODE_QUESTIONS = (
    "What is the difference between a list and a tuple in Python?",
    "How do I read a CSV file in Python?",
    "What is recursion? Show an example.",
    "How do I handle exceptions in JavaScript?",
    "What does git rebase do?",
    "How do I make an HTTP request in Python?",
    "What is a closure in programming?",
    "How do I create a virtual environment in Python?",
    "What is the difference between SQL JOIN types?",
    "How do I sort a dictionary by value in Python?",
    "What is Big O notation?",
    "How do I centre a div in CSS?",
    "What is an API?",
    "How do I use async and await in JavaScript?",
    "What is object-oriented programming?",
    "How do I write a unit test in Python?",
    "What is a pointer in C?",
    "How do I remove a file in bash?",
    "What are decorators in Python?",
    "How do I merge two dictionaries in Python?",
)  # fmt: skip

FOLLOW_UPS = (
    "Can you give me an example?", "Can you make that shorter?", "Why is that?",
    "Tell me more about the first point.", "Can you explain that more simply?",
    "Thanks! What else should I know?", "Can you put that in a list?", "Is that always true?",
    "What would you recommend for a beginner?", "Can you summarise that in one sentence?",
    "That's helpful. What are common mistakes?", "How would you explain it to a child?",
    "Could you write it again in a more formal tone?", "What's the most important part?",
)  # fmt: skip

REWRITES = (
    "Summarize this in one sentence:", "Summarize this in two sentences:",
    "Rewrite this in simpler words:", "Make this shorter:", "Turn this into bullet points:",
    "Rewrite this in a more formal tone:", "Rewrite this in a friendly, casual tone:",
    "What is the main idea of this text?", "Give this text a title:",
    "Fix any grammar mistakes in this text:", "Explain this text to a child:",
)  # fmt: skip

NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack")
ITEMS = ("apples", "pencils", "stickers", "books", "cookies", "marbles", "cards", "oranges")


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 60), r.randint(2, 30), r.randint(2, 9)
    n1, n2 = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    return r.choice(
        (
            f"{n1} has {a} {item} and gives {b} to {n2}. How many {item} does {n1} have left?",
            f"A shop sells {item} for {c} dollars each. How much do {a} {item} cost?",
            f"A train travels {a * 10} km in {c} hours. What is its average speed?",
            f"What is {b}% of {a * 20}?",
            f"A rectangle is {a} cm long and {b} cm wide. What is its area and perimeter?",
            f"{n1} is {c} years older than {n2}. Together they are {2 * a + c} years old. "
            f"How old is each of them?",
            f"A recipe needs {c} eggs for {b} people. How many eggs for {b * c} people?",
            f"If {n1} saves {b} dollars a week, how many weeks until {n1} has {a * b} dollars?",
            f"A car uses {c} litres of fuel per 100 km. How much fuel for {a * 10} km?",
            f"{n1} reads {b} pages a day. How long to finish a {a * b + c} page book?",
            f"Convert {a} miles to kilometres.",
            f"What is {a} times {b}, minus {c}?",
            f"A pizza is cut into {c + 3} slices and {n1} eats {c}. What fraction is left?",
            f"The price of a jacket is {a * 5} dollars and it is {b}% off. What is the sale price?",
        )
    )


def _single_turn(r: random.Random) -> tuple[str, str]:
    """One (kind, user message) of round 1's everyday kinds."""
    t, t2 = r.sample(TOPICS, 2)
    a = r.choice(ACTIVITIES)
    kind = r.choice(
        ("question", "explanation", "howto", "creative", "practical", "list", "advice", "math")
    )
    options = {
        "question": (
            f"What is {t}?", f"Why is {t} important?", f"How does {t} work?",
            f"What is the history of {t}?", f"What are some common myths about {t}?",
            f"What should everyone know about {t}?", f"Tell me something interesting about {t}.",
            f"What is the difference between {t} and {t2}?",
        ),
        "explanation": (
            f"Explain {t} in simple terms.", f"Explain {t} to a five-year-old.",
            f"Can you explain the basics of {t}?", f"Give me a short explanation of {t}.",
            f"Explain {t} like I'm a complete beginner.", f"Explain how {t} affects daily life.",
        ),
        "howto": (
            f"How do I {a}?", f"Give me step-by-step instructions to {a}.",
            f"What's the easiest way to {a}?", f"Any tips on how to {a}?",
            f"I want to {a}. Where do I start?",
        ),
        "creative": (
            f"Write a {r.choice(FORMS)} about {t}.",
            f"Write a story about {r.choice(CHARACTERS)} who {r.choice(SITUATIONS)}.",
            f"Write a {r.choice(FORMS)} about {r.choice(CHARACTERS)}.",
        ),
        "practical": (
            f"Write an email to {r.choice(RECIPIENTS)} about {r.choice(MATTERS)}.",
            f"Write a short message to {r.choice(RECIPIENTS)} about {r.choice(MATTERS)}.",
            f"Write a product description for {r.choice(PRODUCTS)}.",
            f"Write a short speech about {t} for a school assembly.",
            f"Write an advertisement for {r.choice(PRODUCTS)}.",
            f"Write a social media post about {t}.",
        ),
        "list": (
            f"List {r.randint(3, 10)} facts about {t}.", f"Give me {r.randint(3, 8)} ideas "
            f"related to {t}.", f"What are the pros and cons of {t}?", f"Compare {t} and {t2}.",
            f"List the steps to {a}.", f"Give me a checklist to {a}.",
            f"What are the most important things to know about {t}? Use a list.",
        ),
        "advice": (
            f"I'm nervous about {t}. Any advice?", f"Should I learn about {t} or {t2} first?",
            f"My friend wants to {a} but keeps failing. What should they do?",
            f"What books or resources would you recommend about {t}?",
            f"I have one free afternoon. Should I {a}?",
        ),
    }  # fmt: skip
    return kind, _math(r) if kind == "math" else r.choice(options[kind])


def _code(r: random.Random) -> str:
    lang = r.choice(LANGUAGES)
    task = r.choice(CODE_TASKS)
    return r.choice(
        (
            f"Write a {lang} function that {task}.",
            f"How do I write code in {lang} that {task}?",
            f"Show me a {lang} program that {task}, with comments.",
            r.choice(CODE_QUESTIONS),
        )
    )


@functools.cache
def _stdlib_texts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(code prompts, prose passages) of the standard library, from one parse of each file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
    prompts, passages = [], []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        prompts += _function_prompts(tree)
        for para in (ast.get_docstring(tree) or "").split("\n\n"):
            para = " ".join(para.split())
            if 200 <= len(para) <= 900 and para.count(".") >= 2 and ">>>" not in para:
                passages.append(para)
    return tuple(prompts), tuple(passages)


def _function_prompts(tree: ast.Module) -> list[str]:
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) > 1200:
            continue
        args = ast.unparse(node.args)
        if args.startswith("self"):
            args = args[4:].lstrip(", ")
        code = f'def {node.name}({args}):\n    """{doc}\n    """\n'
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        prompts.append(complete_function(code))
        if 20 < len(summary) < 300:
            prompts.append(f"Write a Python function `{node.name}` that does this: {summary}")
    return prompts


def stdlib_code_prompts() -> tuple[str, ...]:
    """The stdlib's public functions with docstrings, asked two ways: "complete this function"
    (the form the held-out HumanEval prompts take) and "write a function that ..."."""
    return _stdlib_texts()[0]


def stdlib_passages() -> tuple[str, ...]:
    """Prose paragraphs (module docstrings, 200-900 characters) that ship with Python."""
    return _stdlib_texts()[1]


def round_one(seed: int, count: int, code_share: float = 0.3) -> list[tuple[str, Turns]]:
    """`count` (kind, single-turn chat) pairs: everyday requests, code, and rewrites of stdlib
    prose, shuffled with `seed`."""
    r = random.Random(seed)
    stdlib = stdlib_code_prompts()
    passages = stdlib_passages()
    out = []
    for _ in range(count):
        u = r.random()
        if u < code_share / 2:
            kind, text = "code", r.choice(stdlib)
        elif u < code_share:
            kind, text = "code", _code(r)
        elif u < code_share + 0.06:
            kind, text = "summary", f"{r.choice(REWRITES)}\n\n{r.choice(passages)}"
        else:
            kind, text = _single_turn(r)
        out.append((kind, [{"role": "user", "content": text}]))
    return out


def round_two(seed: int, answered: list[tuple[str, Turns, str]], count: int):
    """`count` (kind, chat) pairs built on round 1's (kind, turns, answer text): a follow-up
    turn of the same conversation, or a rewrite of the target's own answer."""
    r = random.Random(seed + 1)
    prose = [a for k, _, a in answered if k not in ("code", "math") and len(a) > 200]
    out = []
    for _ in range(count):
        if r.random() < 0.7:
            _, turns, answer = r.choice(answered)
            chat = [
                *turns,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": r.choice(FOLLOW_UPS)},
            ]
            out.append(("conversation", chat))
        else:
            text = f"{r.choice(REWRITES)}\n\n{r.choice(prose)}"
            out.append(("summary", [{"role": "user", "content": text}]))
    return out


def assert_disjoint() -> None:
    """No held-out topic word appears in any training list."""
    words = " ".join(
        TOPICS + ACTIVITIES + CHARACTERS + SITUATIONS + PRODUCTS + CODE_TASKS + CODE_QUESTIONS
        + MATTERS + RECIPIENTS + FORMS + FOLLOW_UPS + ITEMS
    ).lower()  # fmt: skip
    clash = [t for t in HELD_OUT_TOPICS if t in words]
    if clash:
        raise AssertionError(f"held-out topics in the training grid: {clash}")
