"""Chapter 13's answers, checked by `make test` against what the package computes."""

ANSWERS = {
    "1": 32,  # one engine step samples one token per sequence, and the server sends one chunk per step
    "2": 50,  # the sixteen requests of section 3: ceil((prompt + output) / 16) each, summed
}
