"""The held-out everyday prompts: what a chat model is asked besides "complete this function".

Ten kinds of request, seven conversations each, written by hand for evaluation only: neither
these prompts nor their topics (`HELD_OUT_TOPICS`) nor their phrasings appear in the draft's
training data (`blockspec.models.prompts` builds that from a disjoint topic list, and
tests/test_draft_prompts.py checks the two stay apart). Each conversation is a list of chat
turns ending with a user turn; the model's answer to it is what gets measured.
"""

from __future__ import annotations

from blockspec.workers.models import render_chat

Turns = list[dict[str, str]]


def _user(text: str) -> Turns:
    return [{"role": "user", "content": text}]


def _chat(*texts: str) -> Turns:
    """Alternating user / assistant turns, starting and ending with the user."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


# The topics the held-out prompts are about; the training grid must not use any of them.
HELD_OUT_TOPICS = (
    "volcan", "vaccine", "compound interest", "sourdough", "honeybee", "roman empire",
    "jazz", "glacier", "chess", "solar panel", "coral reef", "lighthouse", "origami",
    "marathon", "tide", "submarine", "penguin", "wildfire", "time zone", "elevator",
    "rainbow", "kite", "octopus", "printing press", "mushroom", "thunderstorm", "library",
    "bicycle", "lemonade", "dentist", "aquarium", "umbrella", "greenhouse", "violin",
    "savings account", "jpeg", "pandas", "celsius", "hash map",
)  # fmt: skip

EVERYDAY: dict[str, list[Turns]] = {
    "question": [
        _user("Why do volcanoes erupt?"),
        _user("How long does it take for a glacier to move one meter?"),
        _user("Do penguins have knees?"),
        _user("What causes the tides in the ocean?"),
        _user("Is it safe to stand under a tree during a thunderstorm?"),
        _user("Why are there different time zones around the world?"),
        _user("How many arms does an octopus have, and can it regrow them?"),
    ],
    "explanation": [
        _user("Explain how vaccines train the immune system, in simple terms."),
        _user("Explain compound interest to a teenager with a small example."),
        _user("Can you explain how a submarine dives and comes back up?"),
        _user("Explain why rainbows are curved."),
        _user("Explain what a coral reef is and why it matters for the ocean."),
        _user("Explain how an elevator knows which floor to stop at."),
        _user("Explain how the printing press changed Europe."),
    ],
    "howto": [
        _user("How do I make a sourdough starter at home?"),
        _user("How can I fold a simple origami crane? Give me the steps."),
        _user("What is the best way to train for my first marathon in 16 weeks?"),
        _user("How do I fly a kite on a day with little wind?"),
        _user("How should I clean a freshwater aquarium?"),
        _user("How do I tune a violin without a tuner?"),
        _user("How do I pick mushrooms safely in the forest?"),
    ],
    "creative": [
        _user("Write a haiku about a lighthouse at night."),
        _user("Write a short story about a honeybee who is afraid of flowers."),
        _user("Write a poem about a lost umbrella."),
        _user("Write a limerick about a penguin who wants to fly."),
        _user("Write the opening paragraph of a mystery novel set in a library."),
        _user("Write a short bedtime story about a kite that flies to the moon."),
        _user("Write four lines of a song about riding a bicycle in the rain."),
    ],
    "practical": [
        _user("Write an email to my dentist asking to move my appointment to next Friday."),
        _user("Write a short product description for a phone charger with a built-in solar panel."),
        _user("Write a polite note to my neighbour asking them to water my greenhouse plants."),
        _user("Draft a message to my team saying the library meeting is cancelled."),
        _user("Write a thank-you card for a friend who taught me chess."),
        _user("Write a job posting for a part-time assistant at a bicycle shop."),
        _user("Write a sign for a lemonade stand that makes people want to stop."),
    ],
    "summary": [
        _user(
            "Summarize this in one sentence:\n\nVolcanic eruptions happen when magma rises "
            "through cracks in the Earth's crust. Pressure from gases dissolved in the magma "
            "builds until it is released, sometimes gently as lava flows and sometimes "
            "violently as ash and rock thrown high into the air."
        ),
        _user(
            "Rewrite this so a child can understand it:\n\nHoneybees communicate the "
            "location of food sources through a behaviour known as the waggle dance, in which "
            "the angle and duration of the dance encode direction and distance."
        ),
        _user(
            "Make this shorter:\n\nWe would like to inform all residents that, due to "
            "scheduled maintenance work on the building's elevator system, the elevators will "
            "be out of service from Monday morning until Wednesday evening. We apologise for "
            "any inconvenience this may cause and thank you for your patience."
        ),
        _user(
            "Turn this into three bullet points:\n\nThe Roman Empire built roads that "
            "connected its provinces, which helped armies move quickly and traders carry "
            "goods. It also spread Latin, which became the root of many modern languages, and "
            "its laws influenced legal systems that are still used today."
        ),
        _user(
            "Summarize the main idea:\n\nJazz began in New Orleans in the early twentieth "
            "century, mixing blues, ragtime and brass band music. Musicians improvised over "
            "chord changes, and the style spread to Chicago and New York, where big bands and "
            "later bebop took it in new directions."
        ),
        _user(
            "Rewrite this in a more formal tone:\n\nHey, the wildfire near the hills is "
            "getting bad, so we're closing the trail this weekend. Sorry folks, stay safe!"
        ),
        _user(
            "Summarize this review in a few words:\n\nI bought this umbrella last month and "
            "it has already survived three storms. It folds small, dries fast, and the handle "
            "feels solid. The only downside is that it is a bit heavy for my bag."
        ),
    ],
    "list": [
        _user("List five fun facts about octopuses."),
        _user("Give me six ideas for a rainy-day activity with kids that involves a library."),
        _user("List the things I should pack for a camping trip near a glacier."),
        _user("What are some good names for a pet penguin? Give me a list."),
        _user("List the pros and cons of installing solar panels on a house."),
        _user("Give me a shopping list for making lemonade for twenty people."),
        _user("List seven famous jazz musicians and one song by each."),
    ],
    "math": [
        _user("A lighthouse flashes every 12 seconds. How many times does it flash in an hour?"),
        _user(
            "I put 500 dollars in a savings account with 4% interest per year, compounded "
            "yearly. How much will I have after 3 years?"
        ),
        _user("A marathon is 42.2 km. If I run at 6 minutes per km, how long will it take me?"),
        _user(
            "An aquarium is 60 cm long, 30 cm wide and 40 cm tall. How many litres of water "
            "does it hold?"
        ),
        _user(
            "A bicycle shop sold 14 bikes on Monday and twice as many on Tuesday. How many "
            "bikes did it sell in the two days?"
        ),
        _user(
            "If a kite string is 50 meters long and makes a 30 degree angle with the ground, "
            "how high is the kite?"
        ),
        _user("A lemonade stand sells cups for 75 cents. How many cups make 30 dollars?"),
    ],
    "code": [
        _user("Write a JavaScript function that checks whether a chess move is on the board."),
        _user("Write a SQL query that finds the ten most borrowed books in a library database."),
        _user("Write a bash script that renames every .jpeg file in a folder to .jpg."),
        _user("In pandas, how do I group a DataFrame of sales by month and sum each group?"),
        _user("Write a C function that converts a temperature from Celsius to Fahrenheit."),
        _user("Write a Python class for a simple elevator that moves between floors."),
        _user("How do I implement a hash map from scratch in Java?"),
    ],
    "conversation": [
        _chat(
            "I want to start baking sourdough bread.",
            "That's a great hobby! The first thing you'll need is an active starter, which "
            "takes about a week to build from flour and water.",
            "What flour should I use for the starter?",
        ),
        _chat(
            "Can you recommend a board game for two people?",
            "Chess is a classic choice for two players: it needs only a board and pieces, and "
            "you can play it at any level.",
            "I don't know the rules. How do the pieces move?",
        ),
        _chat(
            "I'm planning a trip to see coral reefs.",
            "Wonderful! Popular places include the Great Barrier Reef in Australia, the Red "
            "Sea and the Caribbean.",
            "Which one is best for a beginner snorkeler?",
        ),
        _chat(
            "My violin sounds scratchy.",
            "A scratchy sound usually comes from the bow: too much pressure, too little rosin, "
            "or a bow placed too close to the bridge.",
            "How much rosin should I use?",
        ),
        _chat(
            "What is a greenhouse?",
            "A greenhouse is a building with glass or plastic walls that traps the sun's heat "
            "so plants can grow in a warm, sheltered space.",
            "Could I build a small one in my backyard?",
        ),
        _chat(
            "I keep forgetting my umbrella at work.",
            "One trick is to keep a spare umbrella at the office and another at home, so you "
            "always have one where you need it.",
            "Any other tips for remembering things?",
        ),
        _chat(
            "I'm scared of going to the dentist.",
            "That's very common. Telling your dentist about your fear helps: they can explain "
            "each step and let you take breaks.",
            "What else can I do to feel calmer before the appointment?",
        ),
    ],
}


def everyday_ids(tokenizer, room: int, per_kind: int | None = None) -> list[tuple[str, list[int]]]:
    """(kind, prompt token ids) for the held-out conversations (the first `per_kind` of each
    kind; all by default), in the chat template, each cut to its last `room` tokens."""
    return [
        (kind, render_chat(tokenizer, turns)[-room:])
        for kind, chats in EVERYDAY.items()
        for turns in chats[:per_kind]
    ]
