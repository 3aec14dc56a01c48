"""The tiny checkpoints' tokenizer: a byte-level BPE trained on a small built-in corpus, offline
and deterministic, with the Qwen2-VL special tokens after its vocabulary."""

from __future__ import annotations

import json
from typing import Any

# Same order (and therefore the same relative ids) as the real Qwen2-VL added tokens.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

_BPE_VOCAB_SIZE = 2000  # trained vocab incl. the 256-symbol byte alphabet; special tokens come after it
# Qwen2's pre-tokenisation regex (the same one transformers' Qwen2Tokenizer rebuilds at load time).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = """\
The harbor town woke slowly. Fishermen hauled wet nets across the cobbled quay while gulls argued
over scraps of herring, and a baker on Mill Street pulled the first golden loaves from a brick oven
older than anyone could remember. By seven o'clock the ferry had sounded its horn twice, children
were racing toward the schoolhouse, and the postmistress was sorting letters from distant cities:
Lisbon, Montreal, Nairobi, Osaka and Valparaíso.

Astronomers have long wondered why some galaxies spin faster at their edges than visible matter
alone would allow. One popular explanation invokes a halo of invisible particles that neither absorb
nor emit light. Another suggests that gravity itself behaves differently across enormous distances.
Careful measurements of lensing, cluster collisions, and the faint afterglow of the early universe
continue to narrow the possibilities, yet nobody has captured a single particle in a laboratory
detector.

Grandmother's recipe for vegetable soup asks for three carrots, two onions, a handful of lentils,
one bay leaf, and patience. Chop everything roughly, sweat the onions in butter until translucent,
then add water and simmer gently for forty minutes. Season with salt, cracked pepper, and a squeeze
of lemon just before serving. The soup tastes even better on the second day, when the flavors have
quietly mingled overnight in the refrigerator.

A good library is never silent. Pages rustle, radiators tick, a printer hums somewhere behind the
reference desk, and students whisper about deadlines. Librarians catalogue maps, manuscripts,
newspapers, and recordings of jazz concerts from decades ago. Visitors borrow novels, biographies,
atlases, and cookbooks; some come only for the warm reading room, the wooden chairs, and the tall
windows that frame the river and the cathedral beyond it.

The train left the valley just after dawn, climbing through pine forests and tunnels carved into
granite. Snow clung to the northern slopes, but meadows facing south were already bright with
crocuses and wild thyme. Passengers pressed their faces to the glass as the carriage crossed a
narrow viaduct high above a turquoise lake. Somewhere near the summit a conductor announced a brief
delay caused by a herd of goats on the tracks.

Engineers who design bridges must consider wind, temperature, traffic, corrosion, and the occasional
earthquake. Steel expands in summer heat and contracts during winter frost, so expansion joints let
the deck breathe without cracking. Modern sensors measure vibration every second and transmit the
data to monitoring software, which warns inspectors whenever something unusual happens. Maintenance
crews repaint the girders every fifteen years.

In the community garden, volunteers rotate crops to keep the soil healthy. Beans fix nitrogen,
squash shades out weeds, and marigolds discourage certain insects. Compost bins behind the shed turn
kitchen peelings, coffee grounds, and autumn leaves into dark crumbly humus. On Saturdays a retired
botanist teaches neighbors how to graft apple trees, prune raspberries, save tomato seeds, and
recognize the difference between useful fungi and blight.

Market day brings a cheerful chaos to the square. Vendors shout prices for peaches, cherries,
walnuts, cheese, honey, olives, and freshly caught mackerel. A violinist plays waltzes near the
fountain while toddlers chase pigeons. Tourists photograph the clock tower, locals haggle politely,
and by noon the smell of grilled sausages and roasted chestnuts drifts across every street. When the
bells strike three, the stalls fold up and vanish.

Computers store numbers as patterns of bits, yet programmers rarely think about voltages or
transistors. Layers of abstraction hide those details: compilers translate readable code into
machine instructions, operating systems juggle memory and processes, and networks move packets
between continents in milliseconds. Still, a single misplaced semicolon or an unchecked boundary can
crash a program, corrupt a file, or expose private data.

The storm arrived without much warning. Thunder rolled over the hills, rain hammered the tin roofs,
and the creek rose until it spilled across the orchard road. Farmers checked their barns by lantern
light, calming frightened horses and moving hay to higher lofts. By morning the sky was rinsed
clean, puddles reflected a pale blue, and a rainbow arched above the flooded fields as if nothing
dramatic had happened at all.

Museums preserve curious objects: bronze helmets, porcelain teacups, embroidered quilts, fossilized
ferns, and telescopes once polished by forgotten instrument makers. Curators write labels,
conservators repair fragile tapestries with silk thread, and guides explain why an ordinary spoon
might reveal ancient trading routes.

Learning a language means stumbling happily through mistakes. Verbs refuse to conjugate, idioms
confuse, and pronunciation twists the tongue. Nevertheless, after months of practice, strangers'
jokes become understandable, menus stop being puzzles, and dreams occasionally unfold entirely in
the new vocabulary.

Her notebook listed quirky questions: why do zebras have stripes, how do owls rotate their necks,
which jellyfish glow, and whether hummingbirds ever sleep? Each answer led somewhere unexpected,
toward physiology, chemistry, evolution, or the peculiar habits of eccentric Victorian explorers who
sketched everything by candlelight.

Marathon runners rehearse pacing, hydration, and stubborn optimism. Around kilometre thirty-two,
muscles complain, knees grumble, and spectators offer oranges, applause, or handwritten signs.
Crossing the finish line feels triumphant, exhausting, emotional, absurd, and wonderful, usually
simultaneously. Afterward, cheerful volunteers sweep sticky cups from pavements while medics bandage
blistered toes with quixotic zeal. Meanwhile, a lighthouse keeper in Zanzibar jotted whimsical haiku
about kaleidoscopic sunsets.
"""


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the byte-level BPE on the built-in corpus; returns (vocab, merges) without special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Same pipeline as transformers' Qwen2Tokenizer, which rebuilds it from vocab/merges when loading.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges


def build_tokenizer() -> Any:
    """A ``Qwen2Tokenizer`` over the trained BPE, with the Qwen2-VL special tokens right after its vocab."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    added = {
        len(vocab) + i: AddedToken(token, special=True, normalized=False)
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    # NOTE: merges as pairs and no unk token are what this tokenizer accepts, whatever its stubs say
    tokenizer: Any = Qwen2Tokenizer
    return tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        added_tokens_decoder=added,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=32768,
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
