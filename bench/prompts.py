"""Unique prompt text for the benchmarks: document i is sentences in a rotating order."""

SENTENCES = [
    "The history of the printing press begins in the fifteenth century in Europe.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "A distributed system is one in which the failure of a computer you did not know existed can render your own computer unusable.",
    "The Pacific Ocean is the largest and deepest of the world's five oceanic divisions.",
    "In mathematics, a prime number is a natural number greater than one with no divisors other than one and itself.",
    "Rivers carve valleys over millions of years, carrying sediment from mountains to the sea.",
    "The recipe calls for flour, butter, sugar, two eggs and a pinch of salt.",
    "Jazz emerged in New Orleans in the early twentieth century, blending blues and ragtime.",
]


def document(i: int, num_sentences: int) -> str:
    """Text that starts "Document {i}." (so no two share a long prefix), then ``num_sentences`` sentences."""
    return f"Document {i}. " + " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(num_sentences))
