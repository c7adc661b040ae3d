"""Deterministic generator of simple English stories and chat samples.

The embedded models are trained only on this text, so everything they can say
comes from here. A small grammar (sentence templates with word slots) keeps the
language simple enough for a ~5M-parameter model to learn on a 2-core CPU,
while hundreds of combinable choices keep it from being trivially repetitive.
The three seed prompts used throughout the notebooks ("Hi, my name is",
"Today is a beautiful summer day", "Hello there") open many of the stories.

Everything is driven by one ``random.Random(seed)``, so a given
``(num_stories, seed)`` reproduces byte for byte.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

TRAIN_SEED = 1234
HELDOUT_SEED = 98765

# fmt: off
BOYS = """Tom Ben Sam Max Leo Jack Tim Finn Noah Luke Owen Jake Eli Dan Ryan Adam Omar Kai Hugo Theo Paul Nick Alex Ted
Oscar Henry Jonas Felix Arthur Simon Peter Louis Billy Milo Ollie Harry Lucas Ethan Mark Joe""".split()
GIRLS = """Lily Mia Emma Anna Lucy Sara Zoe Ella Amy Rose Ruby Grace Maya Nora Ivy Chloe Jane Alice Daisy Clara Kate
Lena Eva Molly Sophie Hannah Julia Olivia Bella Poppy Luna Hazel Fiona Ada Iris Nina Tess Violet Ellie""".split()
AGES = "four five six seven eight nine".split()
COLORS = "red blue green yellow pink purple orange white brown black".split()
PETS = "dog cat puppy kitten bunny parrot turtle hamster goldfish lizard".split()
# Friends get names of their own, so the likeliest friend name never equals the likeliest hero name.
FRIENDS = "Ruth Jasper Rita Oliver Mina Ravi Nell Otto Greta Amir Lola Frank Wendy Pablo Yuki Ingrid".split()
PET_NAMES = """Spot Buddy Coco Bella Pip Milo Lucky Fluffy Biscuit Rex Sunny Peanut Ginger Pepper Snowy Bubbles
Teddy Patch Toby Rosie""".split()
# (animal, adjectives, name it gives itself, where it lives)
ANIMALS = [
    ("owl", ["old", "wise", "sleepy"], "Hoot", "in a hole in the old oak tree"),
    ("rabbit", ["little", "white", "fast"], "Hop", "in a burrow under the hill"),
    ("bear", ["big", "brown", "friendly"], "Bruno", "in a cave in the forest"),
    ("fox", ["clever", "red", "shy"], "Rusty", "in a den near the river"),
    ("frog", ["green", "happy", "little"], "Ribbit", "by the pond"),
    ("duck", ["yellow", "funny", "little"], "Quack", "on the lake"),
    ("squirrel", ["busy", "little", "brown"], "Nutty", "in a tall tree"),
    ("turtle", ["slow", "old", "kind"], "Shelly", "by the river"),
    ("mouse", ["tiny", "gray", "brave"], "Pip", "in a small hole in the wall"),
    ("deer", ["gentle", "young", "shy"], "Dotty", "in the green meadow"),
    ("bird", ["small", "blue", "happy"], "Tweet", "in a nest in the tree"),
    ("cow", ["friendly", "big", "calm"], "Bessie", "on the farm"),
    ("hedgehog", ["little", "prickly", "sleepy"], "Spike", "under a pile of leaves"),
    ("goat", ["funny", "white", "hungry"], "Billy", "on the rocky hill"),
    ("bee", ["busy", "little", "buzzy"], "Buzz", "in a hive in the garden"),
    ("butterfly", ["pretty", "colorful", "tiny"], "Flutter", "in the flower garden"),
    ("penguin", ["cold", "little", "silly"], "Waddle", "on the ice by the sea"),
    ("elephant", ["big", "gray", "gentle"], "Ellie", "near the water hole"),
    ("lion", ["kind", "big", "sleepy"], "Leo", "on the warm grass"),
    ("snail", ["slow", "tiny", "shy"], "Sammy", "under a big green leaf"),
]
HOUSES = [
    "a small house", "a big house", "a little yellow house", "a house by the sea", "a house near the park",
    "a little house on a farm", "a blue house on a hill", "a flat in the city", "a white house with a red door",
    "a cozy house near the woods",
]
FAMILY = [
    "my mom and dad", "my mom", "my dad", "my grandma", "my mom, my dad and my baby sister",
    "my dad and my big brother", "my grandpa and grandma", "my mom and my two brothers",
    "my dad and my little sister", "my aunt and my cousin",
]
HOBBIES = [
    "draw pictures", "play with my ball", "read books", "sing songs", "ride my bike", "build towers with blocks",
    "help my mom cook", "play in the garden", "dance", "look at the stars", "play hide and seek",
    "paint with my brush", "swim in the pool", "play the drum", "jump rope", "climb trees", "make sand castles",
    "play with my cars", "feed the birds", "bake cookies with my grandma", "count the clouds",
    "play football with my friends",
]
FOODS = [
    "apples", "pancakes", "bananas", "cookies", "soup", "ice cream", "bread with honey", "carrots", "cake",
    "cheese", "grapes", "pizza", "sandwiches", "cherries", "rice", "pears", "muffins", "corn", "peas",
    "milk and cereal",
]
TOYS = [
    "red ball", "blue kite", "toy car", "teddy bear", "little boat", "yellow hat", "new doll", "toy train",
    "big book", "green box", "toy robot", "wooden horse", "purple balloon", "toy drum", "little truck",
    "shiny marble", "paper plane",
]
THINGS = [
    "a big red kite", "a pretty butterfly", "a shiny stone", "a little bird", "an old tree", "a small boat",
    "a rainbow", "a lost puppy", "a funny frog", "a big yellow flower", "a tall tower", "a spotted ladybug",
    "a long train", "a hot air balloon", "a nest with three eggs", "a tiny snail", "a big fire truck",
    "a white cloud shaped like a bunny",
]
MORNINGS = ["look for my breakfast", "say hello to the sun", "go for a little walk", "wash my face"]
FEELINGS = ["happy", "very happy", "glad", "proud", "excited", "calm", "thankful"]

# Season openings: (first sentences, second sentences, places with activities)
SEASONS = {
    "summer": (
        ["Today is a beautiful summer day."],
        ["The sun was warm and the sky was blue.", "The sun was bright and the birds were singing.",
         "It was warm and sunny."],
        {
            "park": ["played on the swings", "ran on the green grass", "played catch with a ball",
                     "went down the big slide"],
            "beach": ["built a big sand castle", "looked for shells", "played in the waves",
                      "ran on the warm sand"],
            "lake": ["fed the ducks", "threw stones into the water", "sat by the water", "watched the fish swim"],
            "garden": ["watered the flowers", "looked for bugs", "picked red strawberries", "played with the hose"],
            "zoo": ["saw the big elephants", "watched the monkeys play", "fed the goats",
                    "looked at the tall giraffes"],
            "farm": ["fed the chickens", "rode a little pony", "looked for eggs", "played in the hay"],
        },
    ),
    "spring": (
        ["Today is a warm spring day.", "It was a sunny spring morning."],
        ["The flowers were pink and yellow.", "The trees had new green leaves."],
        {
            "park": ["played on the swings", "picked little flowers", "flew a kite"],
            "farm": ["fed the baby lambs", "saw the little chicks", "rode on a big tractor"],
            "meadow": ["picked flowers", "chased butterflies", "rolled in the grass"],
        },
    ),
    "autumn": (
        ["Today is a cool autumn day.", "It was a windy autumn morning."],
        ["The leaves were red and yellow.", "The wind was cool and the leaves were falling."],
        {
            "forest": ["jumped in the leaves", "picked up pine cones", "walked on a little path"],
            "park": ["jumped in big piles of leaves", "flew a kite in the wind", "collected pretty leaves"],
            "farm": ["picked big orange pumpkins", "picked red apples", "fed the horses"],
        },
    ),
    "winter": (
        ["Today is a cold winter day.", "It was a snowy winter morning."],
        ["Snow was falling on the roofs.", "Everything was white and soft."],
        {
            "hill": ["went down the hill on a sled", "made a big snowman", "had a snowball fight"],
            "park": ["made a snowman", "made angels in the snow", "threw snowballs"],
        },
    ),
}
ENDINGS = [
    "When the sun went down, {who} went home. {He} was tired but very happy.",
    "At the end of the day, {name} went home with a big smile.",
    "That night, {name} told {his} dad all about the day. It was the best day ever.",
    "Then it was time to go home. {name} could not wait to come back tomorrow.",
    "{who} walked home slowly. What a wonderful day!",
]
# fmt: on


def fill(rng: random.Random, options: Sequence[str], **slots: str) -> str:
    """Pick one template and fill its slots."""
    return rng.choice(options).format(**slots)


def kid(rng: random.Random) -> dict[str, str]:
    """A child protagonist with matching pronouns."""
    boy = rng.random() < 0.5
    he, his, him = ("he", "his", "him") if boy else ("she", "her", "her")
    return {
        "name": rng.choice(BOYS if boy else GIRLS),
        "kind": "boy" if boy else "girl",
        "he": he,
        "He": he.capitalize(),
        "his": his,
        "His": his.capitalize(),
        "him": him,
        "pet": rng.choice(PETS),
        "pet_name": rng.choice(PET_NAMES),
        "toy": rng.choice(TOYS),
    }


def animal(rng: random.Random) -> dict[str, str]:
    """A talking animal for dialogue scenes."""
    kind, adjectives, name, home = rng.choice(ANIMALS)
    return {"animal": kind, "adj": rng.choice(adjectives), "animal_name": name, "home": home}


def meeting(rng: random.Random, k: dict[str, str], a: dict[str, str]) -> list[str]:
    """A kid meets a talking animal: the "Hello there!" / "Hi, my name is" dialogue."""
    a = a | k
    lines = [
        fill(
            rng,
            [
                "Then {name} saw {an} {adj} {animal}.",
                "Suddenly, {name} saw {an} {adj} {animal} near a tree.",
                "Soon {he} met {an} {adj} {animal}.",
            ],
            an="an" if a["adj"][0] in "aeiou" else "a",
            **a,
        ),
        fill(
            rng,
            [
                '"Hello there!" said the {adj} {animal}.',
                '"Hello there, little {kind}!" said the {adj} {animal}.',
                '"Hello there! Who are you?" asked the {adj} {animal}.',
            ],
            **a,
        ),
        fill(
            rng,
            [
                '"Hi, my name is {name}," said the {kind}. "What is your name?"',
                '"Hi, my name is {name}," {he} said. "Who are you?"',
                '"Hi, my name is {name}. What is your name?" asked the {kind}.',
            ],
            **a,
        ),
        fill(
            rng,
            [
                '"My name is {animal_name}," said the {animal}. "I live {home}."',
                '"I am {animal_name}," said the {animal}. "I live {home}."',
            ],
            **a,
        ),
    ]
    lines += rng.choice(
        [
            [
                '"Do you want to play with me?" asked {animal_name}.',
                '"Yes, please!" said {name}.',
                "They played together all afternoon. {name} was very happy to have a new friend.",
            ],
            [
                '"Can you help me?" asked {animal_name}. "I lost my way home."',
                '"Yes, I can help you," said {name}.',
                '{name} and {animal_name} walked together until they found the way. "Thank you!" said the {animal}.',
            ],
            [
                '"I am hungry," said {animal_name}.',
                "{name} shared {his} {food} with the {animal}.",
                '"Thank you, {name}! You are very kind," said {animal_name}.',
            ],
            [
                '"Will you be my friend?" asked {animal_name}.',
                '"Yes, I will be your friend," said {name} with a big smile.',
                "From that day on, {name} and {animal_name} were best friends.",
            ],
        ]
    )
    food = rng.choice(FOODS)
    return [s.format(food=food, **a) for s in lines]


def day_out(rng: random.Random) -> str:
    """'Today is a beautiful summer day. Tom and his dog went to the park...'."""
    k = kid(rng)
    season = "summer" if rng.random() < 0.55 else rng.choice(list(SEASONS))
    firsts, seconds, places = SEASONS[season]
    place = rng.choice(list(places))
    friend = rng.choice(FRIENDS)
    who = rng.choice(
        ["{name} and {his} {pet}", "{name} and {his} mom", "{name} and {his} friend " + friend, "{name}"]
    ).format(**k)
    lines = [
        rng.choice(firsts),
        f"{who} went to the {place}." if rng.random() < 0.6 else rng.choice(seconds),
    ]
    if not lines[1].startswith(who):
        lines.append(f"{who} went to the {place}.")
    acts = rng.sample(places[place], 2)
    they = "They" if " and " in who else k["He"]
    lines.append(f"{they} {acts[0]} and {acts[1]}.")
    event = rng.random()
    if event < 0.45:
        lines += meeting(rng, k, animal(rng))
    elif event < 0.55 and season != "winter":
        lines += [
            f"Then they had a picnic under a big tree. They ate {rng.choice(FOODS[:10])} and {rng.choice(FOODS[10:])}.",
            fill(rng, ["Suddenly, it started to rain!", "Then a big gray cloud came, and it started to rain!"]),
            fill(rng, ["{name} ran under the tree and waited.", "Everyone ran under the tree and waited."], **k),
            "Soon the sun came out again, and they saw a beautiful rainbow.",
            fill(
                rng,
                ['"Look, a rainbow!" said {name}. "It has so many colors!"', '"Wow!" said {name}. "I love rainbows!"'],
                **k,
            ),
        ]
    elif event < 0.75:
        thing = rng.choice(THINGS)
        lines += [
            f"Then {k['name']} saw {thing}.",
            fill(
                rng,
                [
                    '"Look!" said {name}. "It is so pretty!"',
                    '"Wow!" said {name}. "Come and see!"',
                    '"Look at that!" said {name}.',
                ],
                **k,
            ),
            fill(
                rng,
                ["{name} smiled. {He} felt {feel}.", "{He} looked at it for a long time. {He} felt {feel}."],
                feel=rng.choice(FEELINGS),
                **k,
            ),
        ]
    else:
        lines += [
            fill(rng, ["{name} had {his} {toy} with {him}.", "{name} brought {his} {toy}."], **k),
            fill(
                rng,
                [
                    "But the {toy} fell into the water!",
                    "Then the wind took the {toy} away!",
                    "But {name} lost {his} {toy}!",
                ],
                **k,
            ),
            fill(rng, ['"Oh no!" said {name}. {He} was very sad.', '{name} began to cry. "Where is my {toy}?"'], **k),
            fill(
                rng,
                [
                    "A kind man found it and gave it back.",
                    "{His} {pet} ran and found it.",
                    "{His} mom helped {him} look, and they found it under a bush.",
                ],
                **k,
            ),
            fill(
                rng,
                [
                    '"Thank you!" said {name}. {He} was happy again.',
                    "{name} hugged {his} {toy}. Now {he} was happy again.",
                ],
                **k,
            ),
        ]
    lines.append(fill(rng, ENDINGS, who=who, **k))
    return " ".join(lines)


def intro(rng: random.Random) -> str:
    """First-person story opening with 'Hi, my name is ...'."""
    k = kid(rng)
    age, color = rng.choice(AGES), rng.choice(COLORS)
    # Two disjoint halves: a greedy decoder would otherwise pick the likeliest hobby twice.
    hobbies = rng.choice(HOBBIES[:11]), rng.choice(HOBBIES[11:])
    lines = [
        fill(
            rng,
            [
                "Hi, my name is {name}.",
                "Hi, my name is {name} and I am {age} years old.",
                "Hi, my name is {name}. I am {age} years old.",
            ],
            age=age,
            **k,
        ),
        f"I live in {rng.choice(HOUSES)} with {rng.choice(FAMILY)}.",
        fill(
            rng,
            ["I have a {pet} named {pet_name}.", "I have a little {pet} called {pet_name}."],
            **k,
        ),
        f"I like to {hobbies[0]} and {hobbies[1]}.",
        fill(
            rng,
            ["My favorite color is {c}.", "My favorite food is {f}.", "I love {f} and my favorite color is {c}."],
            c=color,
            f=rng.choice(FOODS),
        ),
    ]
    day = rng.choice(["Today", "Yesterday", "Last week"])
    verb = "is" if day == "Today" else "was"
    lines += rng.choice(
        [
            [
                f"{day} {verb} a special day.",
                f"My mom gave me a new {color} {rng.choice(TOYS).split()[-1]}.",
                "I said thank you and gave her a big hug.",
            ],
            [f"{day} I went to the park with {k['pet_name']}.", f"We saw {rng.choice(THINGS)}.", "It was so much fun."],
            [
                f"{day} my friend {rng.choice(FRIENDS)} came to play.",
                f"We {rng.choice(['played with blocks', 'drew pictures', 'had a picnic', 'played hide and seek'])}.",
                "I like my friend very much.",
            ],
        ]
    )
    lines.append(rng.choice(["I am very happy.", "I love my family.", "Goodbye for now!", "That is all about me."]))
    return " ".join(lines)


def hello(rng: random.Random) -> str:
    """Story opening with 'Hello there', told by an animal or a friendly narrator."""
    a = animal(rng)
    if rng.random() < 0.6:
        lines = [
            fill(
                rng,
                [
                    "Hello there! My name is {animal_name}, and I am {an} {adj} {animal}.",
                    "Hello there! I am {animal_name}, the {adj} {animal}.",
                    "Hello there, friend! My name is {animal_name}. I am {an} {adj} {animal}.",
                ],
                an="an" if a["adj"][0] in "aeiou" else "a",
                **a,
            ),
            f"I live {a['home']}.",
            "Every morning, I wake up and " + rng.choice(MORNINGS) + ".",
            rng.choice(
                ["I like to play with my friends.", "I like to sit in the sun.", "I like to sing songs in the morning."]
            ),
            f"One day, I met a {kid(rng)['kind']} in the {rng.choice(['forest', 'park', 'garden', 'meadow'])}.",
            rng.choice(
                [
                    "The child gave me some bread, and we became friends.",
                    "We played together until the sun went down.",
                    "The child was lost, so I showed the child the way home.",
                ]
            ),
            rng.choice(["Now I have a new friend.", "It was a very good day.", "I hope you have a good day too!"]),
        ]
        return " ".join(lines)
    k = kid(rng)
    return " ".join(
        [
            fill(
                rng,
                [
                    "Hello there, friend! Let me tell you a story.",
                    "Hello there! Do you want to hear a story?",
                    "Hello there, little one. Here is a story for you.",
                ],
            ),
            f"Once upon a time, there was a {k['kind']} named {k['name']}.",
            f"One day, {k['name']} went for a walk in the {rng.choice(['forest', 'park', 'meadow'])}.",
            *meeting(rng, k, a),
            "The end.",
        ]
    )


def fable(rng: random.Random) -> str:
    """'Once upon a time' stories with a small problem and a kind solution."""
    k = kid(rng)
    a = animal(rng)
    place = rng.choice(["near a big forest", "in a small town", "on a farm", "by the sea", "in a little village"])
    lines = [
        fill(
            rng,
            [
                "Once upon a time, there was a {kind} named {name}.",
                "Once upon a time, there was a little {kind} named {name}.",
                "One day, a {kind} named {name} woke up early.",
            ],
            **k,
        ),
        f"{k['He']} lived {place}.",
    ]
    plot = rng.random()
    if plot < 0.15:
        bird = rng.choice(["little bird", "baby bird", "small blue bird"])
        lines += [
            f"One morning, {k['name']} found a {bird} on the ground.",
            fill(rng, ["The bird had a hurt wing and could not fly.", "The bird was cold and could not fly."]),
            fill(
                rng,
                [
                    '"Do not be scared," said {name}. "I will help you."',
                    '"Poor bird," said {name}. "I will take care of you."',
                ],
                **k,
            ),
            fill(
                rng,
                [
                    "{name} made a soft bed in a box and gave the bird some water.",
                    "{He} gave the bird seeds and kept it warm.",
                ],
                **k,
            ),
            "Every day, the bird got a little stronger.",
            "One sunny day, the bird flew up into the sky.",
            fill(
                rng,
                [
                    '"Goodbye, bird!" said {name}. {He} was sad, but also very glad.',
                    "The bird sang a happy song for {name} before it flew away.",
                ],
                **k,
            ),
        ]
    elif plot < 0.3:
        who = rng.choice(["mom", "dad", "grandma", "grandpa"])
        lines += [
            f"Tomorrow was {k['his']} {who}'s birthday, and {k['name']} wanted to make a gift.",
            fill(rng, ["{He} thought and thought.", "But {he} did not have any money."], **k),
            fill(
                rng,
                [
                    "Then {he} had an idea. {He} would bake a cake!",
                    "Then {he} had an idea. {He} would draw a picture!",
                    "Then {he} had an idea. {He} would pick some flowers!",
                ],
                **k,
            ),
            fill(rng, ["{He} worked very hard all afternoon.", "It was hard work, but {he} did not give up."], **k),
            f"The next day, {k['name']} gave the gift to {k['his']} {who}.",
            fill(
                rng,
                [
                    '"Thank you, {name}! I love it," said {w}, and gave {him} a big hug.',
                    '"This is the best gift ever!" said {w} with a big smile.',
                ],
                w=who.capitalize(),
                **k,
            ),
        ]
    elif plot < 0.45:
        lines += [
            fill(
                rng, ["{name} had a {toy}. {He} loved it very much.", "{name} got a new {toy} from {his} grandma."], **k
            ),
            fill(
                rng,
                [
                    "One day, {his} friend {f} wanted to play with the {toy}.",
                    "One day, {his} friend {f} came over and looked at the {toy}.",
                ],
                f=rng.choice(FRIENDS),
                **k,
            ),
            fill(
                rng,
                [
                    'At first, {name} did not want to share. "It is mine!" {he} said.',
                    '"Can I play too?" asked the friend.',
                ],
                **k,
            ),
            fill(rng, ["Then {name} saw that {his} friend was sad.", "{name} thought about it for a moment."], **k),
            fill(rng, ['"Let us play together," said {name}.', '"Here, you can play with it too," said {name}.'], **k),
            "They played together and had lots of fun.",
            rng.choice(
                ["{name} learned that sharing makes everyone happy.", "Sharing is fun when you have a friend."]
            ).format(**k),
        ]
    elif plot < 0.75:
        where = rng.choice(["in the forest", "by the river", "in the meadow", "in the park"])
        lines += [f"One day, {k['name']} went for a walk {where}."]
        lines += meeting(rng, k, a)
        lines += [
            rng.choice(
                [
                    "The end.",
                    "It was a happy day.",
                    f"{k['name']} went home and told {k['his']} mom about {a['animal_name']}.",
                ]
            )
        ]
    else:
        parent = rng.choice(["mom", "dad"])
        lines += [
            fill(
                rng,
                [
                    "{name} was scared of the dark.",
                    "{name} was afraid of the big dog next door.",
                    "{name} did not like to swim.",
                ],
                **k,
            ),
            fill(
                rng,
                ['"I am scared," {he} told {his} {p}.', '"I do not want to," {he} said to {his} {p}.'],
                p=parent,
                **k,
            ),
            fill(
                rng,
                [
                    '"It is okay to be scared," said {P}. "I am here with you."',
                    '"You are brave," said {P}. "Let us try together."',
                ],
                P=parent.capitalize(),
                **k,
            ),
            fill(rng, ["So {name} tried, one small step at a time.", "{name} took a deep breath and tried."], **k),
            "Soon, it was not scary at all.",
            fill(rng, ['"I did it!" said {name}. {He} felt very proud.', "{name} smiled. {He} was brave now."], **k),
        ]
    return " ".join(lines)


# ---- chat samples (rendered with the tokenizer's chat template) -------------------------
# (question templates, answer template, {key: value}): one fact family per entry.
# fmt: off
FACTS: list[tuple[list[str], str, dict[str, str]]] = [
    (
        ["What color is the {k}?", "Can you tell me the color of the {k}?", "Is the {k} {v}?"],
        "The {k} is {v}.",
        {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "banana": "yellow", "apple": "red",
         "carrot": "orange", "frog": "green", "strawberry": "red", "sea": "blue", "cloud": "white",
         "pumpkin": "orange", "crow": "black", "lemon": "yellow"},
    ),
    (
        ["What sound does {a} {k} make?", "What does {a} {k} say?"],
        "{A} {k} says {v}.",
        {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "pig": "oink", "owl": "hoot",
         "frog": "ribbit", "lion": "roar", "horse": "neigh", "bee": "buzz", "mouse": "squeak", "snake": "hiss",
         "rooster": "cock-a-doodle-doo"},
    ),
    (
        ["How many legs does {a} {k} have?"],
        "{A} {k} has {v} legs.",
        {"dog": "four", "cat": "four", "bird": "two", "spider": "eight", "ant": "six", "cow": "four", "duck": "two",
         "bee": "six", "horse": "four", "chicken": "two", "beetle": "six", "octopus": "eight"},
    ),
    (
        ["Where does {a} {k} live?", "Where do you find {a} {k}?"],
        "{A} {k} lives {v}.",
        {"fish": "in the water", "bird": "in a nest", "bee": "in a hive", "bear": "in a cave",
         "rabbit": "in a burrow", "cow": "on a farm", "owl": "in a tree", "frog": "by the pond",
         "penguin": "where it is cold and icy", "camel": "in the desert", "monkey": "in the jungle"},
    ),
    (
        ["What does {a} {k} eat?", "What food does {a} {k} like?"],
        "{A} {k} likes to eat {v}.",
        {"rabbit": "carrots and grass", "cow": "grass", "monkey": "bananas", "squirrel": "nuts",
         "bird": "seeds and worms", "cat": "fish", "panda": "bamboo", "horse": "hay and apples",
         "bear": "berries, fish and honey", "mouse": "cheese and seeds"},
    ),
    (
        ["What is the opposite of {k}?", "Tell me the opposite of {k}."],
        "The opposite of {k} is {v}.",
        {"hot": "cold", "big": "small", "up": "down", "day": "night", "happy": "sad", "fast": "slow", "old": "new",
         "wet": "dry", "open": "closed", "light": "dark", "loud": "quiet", "tall": "short", "full": "empty",
         "yes": "no", "in": "out", "hard": "soft"},
    ),
    (
        ["What day comes after {k}?", "What is the day after {k}?"],
        "The day after {k} is {v}.",
        dict(zip("Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
                 "Tuesday Wednesday Thursday Friday Saturday Sunday Monday".split(), strict=True)),
    ),
    (
        ["How many sides does {a} {k} have?"],
        "{A} {k} has {v} sides.",
        {"triangle": "three", "square": "four", "rectangle": "four", "pentagon": "five", "hexagon": "six",
         "octagon": "eight"},
    ),
    (
        ["What should I wear when it is {k}?", "It is {k} today. What should I wear?"],
        "When it is {k}, you can wear {v}.",
        {"cold": "a warm coat, a hat and gloves", "raining": "a raincoat and rain boots",
         "sunny": "a sun hat and light clothes", "snowing": "a warm coat, boots and a scarf",
         "windy": "a jacket that keeps you warm"},
    ),
    (
        ["What do you say when someone {k}?", "What should I say when someone {k}?"],
        'When someone {k}, you can say "{v}"',
        {"helps you": "Thank you!", "gives you a gift": "Thank you so much!", "says thank you": "You are welcome!",
         "is sad": "Can I help you?", "says good night": "Good night, sleep well!",
         "bumps into you": "Are you okay?"},
    ),
]
# fmt: on
NUMBERS = "zero one two three four five six seven eight nine ten".split()


def _qa(rng: random.Random) -> tuple[str, str]:
    """One short question with its correct answer."""
    kind = rng.randrange(len(FACTS) + 6)
    if kind < len(FACTS):
        questions, answer, table = FACTS[kind]
        key, value = rng.choice(list(table.items()))
        q = rng.choice(questions)
        article = "an" if key[0] in "aeiou" else "a"
        slots = {"k": key, "v": value, "a": article, "A": article.capitalize()}
        # Yes/no questions ("Is the sky blue?") get a "Yes." in front of the plain fact.
        return q.format(**slots), ("Yes. " if q.startswith("Is ") else "") + answer.format(**slots)
    kind -= len(FACTS)
    if kind == 0:
        q = rng.choice(
            ["Hello!", "Hi!", "Hello there!", "Good morning!", "Hi, my name is " + rng.choice(BOYS + GIRLS) + "."]
        )
        return q, rng.choice(
            [
                "Hello! How can I help you today?",
                "Hi there! It is nice to meet you.",
                "Hello! What would you like to talk about?",
            ]
        )
    if kind == 1:
        q = rng.choice(["What is your name?", "Who are you?", "Tell me about yourself."])
        return q, "My name is Mini. I am a small model that tells simple stories."
    if kind in (2, 3):  # twice as common as the other kinds: 30 sums take many examples to learn
        x, y = rng.randrange(6), rng.randrange(5)
        q = fill(rng, ["What is {x} plus {y}?", "What is {x} and {y}?"], x=NUMBERS[x], y=NUMBERS[y])
        return q, f"{NUMBERS[x].capitalize()} plus {NUMBERS[y]} is {NUMBERS[x + y]}."
    if kind == 4:
        n = rng.randrange(3, 11)
        return f"Can you count to {NUMBERS[n]}?", "Sure! " + ", ".join(
            [NUMBERS[1].capitalize(), *NUMBERS[2 : n + 1]]
        ) + "."
    subject = rng.choice(["cat", "dog", "little bird", "brave girl", "happy boy", "bunny"])
    story = fable(rng) if rng.random() < 0.5 else day_out(rng)
    q = fill(rng, ["Tell me a short story.", "Can you tell me a story?", "Tell me a story about a {s}."], s=subject)
    return q, story


def chat(rng: random.Random) -> list[dict[str, str]]:
    """A chat conversation of one or two turns as a list of messages."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.2 else []
    asked: set[str] = set()
    turns = 1 if rng.random() < 0.8 else 2
    while len(asked) < turns:
        q, a = _qa(rng)
        if q not in asked:
            asked.add(q)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


STORY_KINDS: list[tuple[Callable[[random.Random], str], float]] = [
    (day_out, 0.32),
    (intro, 0.18),
    (hello, 0.16),
    (fable, 0.34),
]


def generate_corpus(num_stories: int, seed: int = TRAIN_SEED) -> list[str]:
    """``num_stories`` plain-text stories (no special tokens), reproducible from ``seed``."""
    rng = random.Random(seed)
    funcs, weights = zip(*STORY_KINDS, strict=True)
    return [rng.choices(funcs, weights)[0](rng) for _ in range(num_stories)]


def generate_chats(num_chats: int, seed: int = TRAIN_SEED) -> list[list[dict[str, str]]]:
    """``num_chats`` chat conversations, reproducible from ``seed``."""
    rng = random.Random(seed + 1)
    return [chat(rng) for _ in range(num_chats)]


if __name__ == "__main__":
    for story in generate_corpus(6, seed=0):
        print(story, end="\n\n")
    print(generate_chats(3, seed=0))
