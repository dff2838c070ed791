"""The ways the general tasks (:mod:`.skills`) say a fact and ask for it, in families, some held out.

A model trained on one sentence per task learns the sentence: the first ``lab-target`` found a pass key in
"The pass key is ..." and not in a template sharing none of its words (1 in 60). Here each task has tens of
phrasings in *families* (a family is a register: "code", "ledger", "let" ...). Training draws the statement
and the question from its families independently, so the question is worded apart from the fact it asks
about and only the key (or the task itself) ties them; the eval card asks in the **held-out families**, whose
content words no training family uses (:func:`content_words`, tested), so it measures the skill and not the
template. Each task's first family, ``"original"``, is the first probes' own wording, which training keeps:
the chapters' probes are then the "trained format" column of the card's robustness table.

Placeholders: ``{k}`` a key, ``{v}`` a value, ``{a}``/``{b}`` variable names. A question ends where its answer
starts; the answer is the value with a leading space (``" 4821"``), or :data:`ABSENT` where the key was never
stated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from labsrc.tasks.pools import HELDOUT, TRAIN, check_split

ABSENT = "none"  # the answer to a question about a key the context never stated


@dataclass(frozen=True)
class Family:
    """One register of phrasings for one task. ``statements`` say the fact; ``questions`` ask for it; ``heads``
    are instructions that may open a sample (empty: none)."""

    name: str
    split: str
    statements: tuple[str, ...]
    questions: tuple[str, ...]
    heads: tuple[str, ...] = ()


def _f(name, split, statements, questions, heads=()):
    return Family(name, split, tuple(statements), tuple(questions), tuple(heads))


# ------------------------------------------------------------------------------------------------ pass key
# One value hidden in prose, no key: the question need not echo the statement at all.
PASSKEY = (
    _f("original", TRAIN, ["The pass key is {v}. Remember it. {v} is the pass key."],
       ["What is the pass key? The pass key is"],
       ["There is a pass key hidden in this text. Find it and remember it."]),
    _f("code", TRAIN, ["The secret code is {v}.", "Remember the secret code: {v}.", "The code to remember is {v}."],
       ["What is the secret code? The secret code is", "What was the code to remember? It was",
        "Secret code:"], ["A secret code is hidden in the text below."]),
    _f("password", TRAIN, ["The password is {v}. Do not forget it.", "Here is the password: {v}.",
                           "Use the password {v} to enter."],
       ["What is the password? The password is", "Tell me the password. Password:"],
       ["Somewhere in this story is a password."]),
    _f("access", TRAIN, ["Your access number is {v}.", "Access is granted with {v}."],
       ["Which access number were you given? It was", "What grants access? Access is granted with"]),
    _f("safe", TRAIN, ["The combination to the safe is {v}.", "The safe opens with {v}."],
       ["What opens the safe? The combination is", "Safe combination:"]),
    _f("memo", TRAIN, ["Memorise this: {v}.", "Please remember {v}; you will be asked for it."],
       ["What were you asked to memorise? You were asked to memorise", "What was to be remembered? Answer:"],
       ["Read carefully: one item must be memorised."]),
    _f("token", TRAIN, ["The token of the day is {v}.", "Today's token: {v}."],
       ["Which token was given for the day? The token was", "Token of the day:"]),
    _f("ticket", TRAIN, ["Your ticket reads {v}.", "Printed on the ticket: {v}."],
       ["What does the ticket read? It reads", "Ticket:"]),
    _f("key", TRAIN, ["The key you need is {v}.", "Keep this key: {v}."],
       ["Which key do you need? You need", "What is the key? The key is"]),
    _f("signal", TRAIN, ["The agreed signal is {v}.", "Signal {v} when ready."],
       ["What is the agreed signal? It is", "Signal:"]),
    # Held out: no content word of these is in any training family.
    _f("cipher", HELDOUT, ["Guard this cipher well: {v}."], ["Produce the guarded cipher:"],
       ["Herein lies a cipher."]),
    _f("watchword", HELDOUT, ["Tonight the sentry's watchword shall be {v}."],
       ["Whisper the sentry's watchword. Tonight it shall be"]),
    _f("figure", HELDOUT, ["Bear in mind the figure {v}."], ["Name the figure borne in mind:"]),
)

# ------------------------------------------------------------------------------------------------ needle
# Several keyed facts; the question names one key and is drawn apart from the statements' family.
NEEDLE = (
    _f("original", TRAIN, ["The special magic number for {k} is {v}."],
       ["What is the special magic number for {k}? The special magic number for {k} is"],
       ["Some special magic numbers are hidden in this text. Remember them."]),
    _f("possessive", TRAIN, ["{k}'s number is {v}.", "The number of {k} is {v}."],
       ["What is {k}'s number? {k}'s number is", "Which number goes with {k}? Answer:"]),
    _f("value", TRAIN, ["The value of {k} is {v}.", "{k} has the value {v}."],
       ["What is the value of {k}? The value of {k} is", "Value of {k}:"],
       ["Several values are given in this text."]),
    _f("map", TRAIN, ["Remember that {k} maps to {v}.", "{k} maps to {v}."],
       ["What does {k} map to? It maps to", "{k} maps to"]),
    _f("label", TRAIN, ["The {k} is labelled {v}.", "A label on the {k} says {v}."],
       ["How is the {k} labelled? It is labelled", "What does the label on the {k} say? It says"]),
    _f("note", TRAIN, ["Note: {k} = {v}.", "Noted, {k} = {v}."], ["{k} =", "Note for {k}:"]),
    _f("register", TRAIN, ["In the register, {k} is entered as {v}.", "The register lists {k} as {v}."],
       ["How is {k} entered in the register? As", "What does the register list for {k}? It lists"],
       ["Entries from a register are scattered through the text."]),
    _f("code", TRAIN, ["The code attached to {k} reads {v}.", "The code for {k} is {v}."],
       ["What is the code for {k}? The code is", "Code for {k}:"]),
    _f("under", TRAIN, ["Under {k} one finds {v}.", "Look under {k} and you will find {v}."],
       ["What is found under {k}? One finds", "What will you find under {k}? You will find"]),
    _f("belongs", TRAIN, ["{v} belongs to {k}.", "The one belonging to {k} is {v}."],
       ["What belongs to {k}? Answer:", "Which one belongs to {k}? The one belonging to {k} is"]),
    _f("assigned", TRAIN, ["{k} was assigned {v}.", "To {k} they assigned {v}."],
       ["What was {k} assigned? It was assigned", "Assigned to {k}:"]),
    # Held out.
    _f("tally", HELDOUT, ["Beside {k} stands the tally {v}."], ["Which tally stands beside {k}? Beside {k} stands"],
       ["Tallies appear here and there."]),
    _f("catalogue", HELDOUT, ["Catalogue entry for {k}: {v}."], ["Consult the catalogue. Entry for {k}:"]),
    _f("marked", HELDOUT, ["Mark {k} with {v} in your notebook."], ["In your notebook, {k} bears the mark"]),
)

# ------------------------------------------------------------------------------------------------ MQAR
# A list of key-value pairs, then queries in the list's own form (Zoology's setting). A statement is the form
# of one pair; its query is the part before {v}. Questions here are the list's separators.
MQAR = (
    _f("original", TRAIN, ["{k}: {v}"], [", "], ["Remember these pairs."]),
    _f("equals", TRAIN, ["{k} = {v}"], ["; "], ["Assignments follow."]),
    _f("arrow", TRAIN, ["{k} -> {v}"], [", "], ["A mapping:"]),
    _f("is", TRAIN, ["{k} is {v}"], [". "], ["Facts to keep:"]),
    _f("lines", TRAIN, ["{k}: {v}"], ["\n"], ["Table:"]),
    # Held out.
    _f("pipe", HELDOUT, ["{k} | {v}"], [" / "], ["Columns:"]),
    _f("paren", HELDOUT, ["({k}, {v})"], [" "], ["Tuples:"]),
)
MQAR_QUERY_HEADS = {TRAIN: ("Recall the pairs.", "Now the queries.", "Answer each:", ""),
                    HELDOUT: ("Retrieve:",)}

# ------------------------------------------------------------------------------------------------ variables
# statements: (first assignment with {a} = {v}, later ones with {b} = {a}); questions about {a}.
VARIABLES = (
    _f("original", TRAIN, ["VAR {a} = {v}.", "VAR {b} = VAR {a}."], ["What is the value of VAR {a}? VAR {a} ="],
       ["Some variables are assigned in this text. Keep track of them."]),
    _f("let", TRAIN, ["let {a} = {v};", "let {b} = {a};"], ["After all this, {a} equals", "Value of {a}:"]),
    _f("holds", TRAIN, ["{a} holds {v}.", "{b} holds what {a} holds."], ["What does {a} hold? {a} holds"]),
    _f("set", TRAIN, ["Set {a} to {v}.", "Set {b} to {a}."], ["What is {a} set to? {a} is set to"],
       ["Follow the assignments."]),
    _f("same", TRAIN, ["{a} is {v}.", "{b} is the same as {a}."], ["So {a} is"]),
    # Held out.
    _f("walrus", HELDOUT, ["{a} := {v}", "{b} := {a}"], ["Resolve {a} fully:"]),
    _f("pour", HELDOUT, ["Pour {v} into {a}.", "Pour {a} into {b}."], ["Whatever finally lands in {a}:"]),
)

# ------------------------------------------------------------------------------------------------ passage
# statements wrap the quoted passage ({v}); questions ask for it back and end where it starts.
PASSAGE = (
    _f("original", TRAIN, [' Here is a passage to remember: "{v}" '],
       ['Repeat the quoted passage word for word: "'],
       ["A passage is quoted in this text. Remember it word for word."]),
    _f("quote", TRAIN, [' Quote: "{v}" ', ' She wrote: "{v}" '], ['Write the quotation out again: "', 'Quote: "']),
    _f("recite", TRAIN, [' Learn these lines by heart: "{v}" '], ['Recite the lines: "', 'The lines were: "']),
    # Held out.
    _f("dictation", HELDOUT, [' For dictation: "{v}" '], ['Take down the dictation once more: "']),
)

TASK_FAMILIES = {"passkey": PASSKEY, "needle": NEEDLE, "mqar": MQAR, "variable_tracking": VARIABLES,
                 "passage": PASSAGE}

# Fillers: the prose of the split (most often), RULER's repeated sentences, or a list of pool words.
RULER_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def families(task: str, split: str) -> tuple[Family, ...]:
    """The phrasing families of ``task`` that ``split`` may use."""
    check_split(split)
    if task not in TASK_FAMILIES:
        raise ValueError(f"task must be one of {tuple(TASK_FAMILIES)}, got {task!r}")
    return tuple(f for f in TASK_FAMILIES[task] if f.split == split)


def family(task: str, name: str) -> Family:
    """The family of ``task`` called ``name``."""
    for f in TASK_FAMILIES.get(task, ()):
        if f.name == name:
            return f
    raise ValueError(f"no family {name!r} for task {task!r}")


_FUNCTION_WORDS = frozenset(
    "a an the is are was were be to of in on for with and or this that these those it its you your what which "
    "who how one will shall here there tell me after all so by as at from when ready each now".split())


def content_words(texts) -> set[str]:
    """The lower-case content words of ``texts`` (placeholders and function words removed): what a held-out
    family must not share with training."""
    out = set()
    for t in texts:
        t = re.sub(r"\{[a-z]\}", " ", t)
        out |= {w for w in re.findall(r"[a-z]+", t.lower()) if w not in _FUNCTION_WORDS and len(w) > 1}
    return out
