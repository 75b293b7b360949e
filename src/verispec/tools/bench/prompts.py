"""A small development prompt set in the spirit of Spec-Bench's tasks (the `own` set of `verispec bench`).

Categories: code (2 prompts); summarization, translation, qa, math, chat (3 each). The texts are original and short so a
CPU run stays quick; every prompt is a single user turn meant for the model's chat template.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from verispec.errors import InvalidParameterError


__all__ = ["Prompt", "PROMPTS", "CATEGORIES", "select_prompts"]


@dataclass(frozen=True)
class Prompt:
    category: str
    name: str
    text: str


_LIGHTHOUSE = (
    "The lighthouse on Karrow Point was built in 1871 after three cargo ships ran aground on the reef "
    "within a single winter. For almost a century a keeper and his family lived in the stone cottage at "
    "its base, trimming the wick every four hours and logging each passing vessel by hand. In 1962 the "
    "light was automated, and the last keeper, Elsie Marr, moved to the mainland village, where she "
    "taught the children to read nautical charts. The cottage stood empty until 2009, when a local trust "
    "restored it as a small museum. Today visitors can climb the 112 steps to the lantern room, read "
    "pages from the original logbooks, and watch the beam sweep the water at dusk, still warning ships "
    "away from the same stretch of rock that wrecked them long ago."
)

_COMPOSTING = (
    "Composting at home turns kitchen scraps and garden waste into dark, crumbly soil. A good heap mixes "
    "green material, such as vegetable peelings, coffee grounds and fresh grass, with brown material, "
    "such as dry leaves, straw and shredded cardboard. Greens supply nitrogen and browns supply carbon; "
    "roughly two parts brown to one part green keeps the heap from turning slimy or smelly. The pile "
    "also needs air and moisture: turning it every week or two lets oxygen reach the microbes, and it "
    "should feel about as damp as a wrung-out sponge. Meat, dairy and oily food attract pests and are "
    "best left out. Depending on the season, finished compost is ready in three months to a year, and "
    "it can be spread on beds to improve both drainage and fertility."
)

_TRAIN_NOTICE = (
    "Please note that the 8:15 train to the city centre will depart from platform 4 instead of platform "
    "2 this week because of maintenance work. Passengers with bicycles should use the rear carriage. "
    "Tickets bought online remain valid, and the café on the main concourse will open one hour earlier "
    "than usual."
)

_LIBRARY_NOTE = (
    "Dear neighbours, the community library will close for two weeks in August while we paint the "
    "reading room and replace the old shelves. Books may still be returned through the slot by the "
    "front door. We are looking for volunteers to help carry boxes on the first Saturday of the month; "
    "coffee and cake will be provided."
)

_BEES = (
    "Honey bees communicate the location of food through the waggle dance. A forager returning to the "
    "hive runs a short straight line while shaking her abdomen, then circles back and repeats. The angle "
    "of the straight run relative to vertical on the comb matches the angle between the food source and "
    "the sun, and the duration of the waggle encodes distance: roughly one second of waggling "
    "corresponds to about one kilometre. Nearby flowers, closer than about fifty metres, are announced "
    "with a simpler round dance that gives no direction. Other bees follow the dancer closely, sensing "
    "the vibrations and the scent of the flowers she carries, and then fly out to search."
)

_GLACIER = (
    "The Vatnajökull glacier in Iceland covers about eight percent of the country. Beneath its ice lie "
    "several active volcanoes, including Grímsvötn, which erupts every five to ten years. When an "
    "eruption melts the ice from below, meltwater collects in a subglacial lake until it bursts out in "
    "a sudden flood called a jökulhlaup. The largest recorded flood, in 1996, destroyed a section of "
    "the ring road and carried icebergs the size of houses onto the coastal plain. Since 1995 the "
    "glacier has lost ice steadily, and scientists estimate it could shrink by a quarter before 2100."
)

_MARKET = (
    "Every Saturday morning the old tram depot in Lindholm turns into a food market. About forty stalls "
    "sell bread, cheese, smoked fish and vegetables from farms within an hour's drive. The market began "
    "in 2014 with six tables and a borrowed generator; it now draws several thousand visitors each week "
    "and has its own rules: sellers must grow, catch or bake what they sell, and plastic bags were "
    "banned in 2019. Some neighbours complain about parking and noise, so the organisers added a "
    "bicycle shelter and moved the live music indoors. The city council is now discussing whether to "
    "open the depot on Wednesday evenings as well."
)

_RECIPE_NOTE = (
    "Preheat the oven to 180 degrees. Mix the flour, sugar and a pinch of salt, then rub in the cold "
    "butter until the mixture looks like breadcrumbs. Add one egg and press the dough into a tin. Bake "
    "for twenty minutes, or until the edges turn golden."
)

_TIDES = (
    "Tides are the regular rise and fall of the sea caused mainly by the Moon's gravity. The Moon pulls "
    "the ocean on the side of the Earth facing it into a bulge, and a second bulge forms on the far side "
    "because the Earth itself is pulled towards the Moon more strongly than the distant water. As the "
    "Earth turns, most coasts pass through both bulges and see two high tides roughly every 24 hours "
    "and 50 minutes. When the Sun and Moon line up, at new and full moon, their pulls add together and "
    "produce spring tides with the largest range; when they are at right angles, the weaker neap tides "
    "follow."
)

PROMPTS: tuple[Prompt, ...] = (
    Prompt("code", "code-lru", (
        "Write a Python class `LRUCache` with a fixed capacity and methods `get(key)` and `put(key, value)`, "
        "both O(1). Use `collections.OrderedDict`, add type hints and a short docstring, then show a "
        "three-line usage example."
    )),
    Prompt("code", "code-csv", (
        "Write a Python function `summarize_csv(path: str) -> dict[str, float]` that reads a CSV file with a "
        "header row and returns the mean of every numeric column, skipping columns that contain any "
        "non-numeric value. Use only the standard library and explain edge cases in comments."
    )),
    Prompt("summarization", "sum-lighthouse", f"Summarize the following text in three sentences.\n\n{_LIGHTHOUSE}"),
    Prompt("summarization", "sum-compost", f"Summarize the following text as a short bulleted list.\n\n{_COMPOSTING}"),
    Prompt("summarization", "sum-market", f"Summarize the following text in one paragraph of at most fifty words.\n\n{_MARKET}"),
    Prompt("translation", "tr-fr-train", f"Translate the following notice from English to French.\n\n{_TRAIN_NOTICE}"),
    Prompt("translation", "tr-de-library", f"Translate the following message from English to German.\n\n{_LIBRARY_NOTE}"),
    Prompt("translation", "tr-es-recipe", f"Translate the following recipe step from English to Spanish.\n\n{_RECIPE_NOTE}"),
    Prompt("qa", "qa-bees", (
        f"Answer the question using only the context.\n\nContext: {_BEES}\n\n"
        "Question: How does a bee indicate that food is about three kilometres away, and in which direction?"
    )),
    Prompt("qa", "qa-glacier", (
        f"Answer the question using only the context.\n\nContext: {_GLACIER}\n\n"
        "Question: What is a jökulhlaup, and what happened during the flood of 1996?"
    )),
    Prompt("qa", "qa-tides", (
        f"Answer the question using only the context.\n\nContext: {_TIDES}\n\n"
        "Question: Why is there a high tide on the side of the Earth facing away from the Moon, and when are spring tides?"
    )),
    Prompt("math", "math-bakery", (
        "A bakery sells muffins for $2.50 each and cookies for $1.20 each. On Monday it sold 84 items and "
        "took in $159.00. How many muffins and how many cookies did it sell? Reason step by step."
    )),
    Prompt("math", "math-tank", (
        "A water tank holds 1,800 litres. One pipe fills it in 6 hours and a drain empties it in 9 hours. "
        "If the tank starts one third full and both are open, how long until it is full? Show your "
        "reasoning step by step."
    )),
    Prompt("math", "math-cyclists", (
        "Two cyclists start 63 km apart and ride towards each other, one at 18 km/h and the other at "
        "24 km/h. The faster one leaves 20 minutes later. How far from the slower cyclist's start do they "
        "meet? Work it out step by step."
    )),
    Prompt("chat", "chat-plants", (
        "I keep forgetting to water my houseplants and two of them have already died. Can you suggest a "
        "few low-maintenance plants and a simple routine that would help me?"
    )),
    Prompt("chat", "chat-talk", (
        "I have to give a five-minute talk to my team next week and I get nervous speaking in public. "
        "What are some practical ways to prepare and stay calm?"
    )),
    Prompt("chat", "chat-cooking", (
        "I want to start cooking dinner at home instead of ordering food, but I only have about thirty "
        "minutes on weekday evenings. How should I plan a week of simple meals?"
    )),
)

CATEGORIES: tuple[str, ...] = tuple(dict.fromkeys(p.category for p in PROMPTS))


def select_prompts(categories: Iterable[str] | None = None, per_category: int | None = None) -> list[Prompt]:
    """The built-in prompts of `categories` (all when None), at most the first `per_category` of each."""
    return select(PROMPTS, categories, per_category)


def select(prompts: Iterable[Prompt], categories: Iterable[str] | None = None, per_category: int | None = None) -> list[Prompt]:
    """The prompts of `categories` (all when None, in first-seen order), at most `per_category` of each."""
    prompts = list(prompts)
    present = list(dict.fromkeys(p.category for p in prompts))
    wanted = list(categories) if categories else present
    unknown = [c for c in wanted if c not in present]
    if unknown:
        raise InvalidParameterError(f"unknown categories {unknown}: use some of {', '.join(present)}")
    if per_category is not None and per_category < 1:
        raise InvalidParameterError(f"per_category must be ≥ 1, got {per_category}")
    return [p for c in wanted for p in [q for q in prompts if q.category == c][:per_category]]

