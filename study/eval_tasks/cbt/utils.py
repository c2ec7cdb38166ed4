"""CBT prompts: the story, then the question sentence split at its blank (XXXXX)."""

BLANK = "XXXXX"


def doc_to_text(doc):
    """The 20 story sentences and the question up to the blank, joined by spaces."""
    return (" ".join(doc["sentences"]) + " " + doc["question"].split(BLANK)[0]).rstrip()


def doc_to_choice(doc):
    """Each candidate followed by the rest of the question sentence, with a leading space."""
    rest = doc["question"].split(BLANK, 1)[1]
    return [" " + option + rest for option in doc["options"]]


def doc_to_target(doc):
    """Index of the answer among the options."""
    return doc["options"].index(doc["answer"])
