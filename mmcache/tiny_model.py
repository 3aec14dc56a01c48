"""Offline, deterministic generator for tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense, MoE) checkpoints.

``make_tiny_model(out_dir)`` writes a complete Hugging Face-format checkpoint (randomly initialised weights, a
byte-level BPE tokenizer trained on a small built-in corpus, image/video processor configs and the family's
chat template) without touching the network. Two runs produce byte-identical files, so the
checkpoint can be regenerated anywhere (tests, CI, benchmarks) instead of being downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

TINY_MODEL_ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")

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

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    # Tools as Qwen2.5 lists them: in the system turn, one JSON signature a line.
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
    "{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}{{ '\\n\\n' }}# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' and message['content'] is string %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for tool_call in message['tool_calls'] or [] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", '
    "\"arguments\": {{ call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL's template: the same content rendering, but no default system message.
_DEFAULT_SYSTEM = (
    "{% if loop.first and message['role'] != 'system' and not tools %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
)
if _DEFAULT_SYSTEM not in CHAT_TEMPLATE:  # an edit to the template must keep this part findable
    raise RuntimeError("CHAT_TEMPLATE lost its default system turn")
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_DEFAULT_SYSTEM, "")

_SEED = 1234
_BPE_VOCAB_SIZE = 2000  # trained vocab incl. the 256-symbol byte alphabet; special tokens come after it
_INITIALIZER_RANGE = 0.1  # well above the 0.02 default so the random model reacts visibly to its inputs
_MIN_PIXELS = 56 * 56
_MAX_IMAGE_PIXELS = 448 * 448
_MAX_VIDEO_PIXELS = 224 * 224
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
    return Qwen2Tokenizer(
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


def _build_config(arch: str, tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text_config: dict[str, Any] = {
        "vocab_size": -(-len(tokenizer) // 64) * 64,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "max_window_layers": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        "initializer_range": _INITIALIZER_RANGE,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    vision_common: dict[str, Any] = {
        "depth": 2,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": _INITIALIZER_RANGE,
    }
    if arch == "qwen2-vl":
        config_cls: Any = Qwen2VLConfig
        vision_config = {**vision_common, "embed_dim": 64, "mlp_ratio": 2, "hidden_size": 128}
    elif arch == "qwen2.5-vl":
        config_cls = Qwen2_5_VLConfig
        vision_config = {
            **vision_common,
            "hidden_size": 64,
            "intermediate_size": 128,
            "out_hidden_size": 128,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        }
    else:
        config_cls = Qwen3VLConfig if arch == "qwen3-vl" else Qwen3VLMoeConfig
        if arch == "qwen3-vl-moe":  # every layer routes each token to 2 of 8 experts
            text_config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
        # Qwen3 text layers: no q/k/v biases, q/k norms, an explicit head_dim, interleaved M-RoPE.
        del text_config["max_window_layers"]
        text_config["head_dim"] = 32
        text_config["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        }
        # Three deepstack layers, as in the real models (there: 8, 16 and 24 of 27).
        vision_config = {
            **vision_common,
            "depth": 3,
            "patch_size": 16,
            "hidden_size": 64,
            "intermediate_size": 128,
            "out_hidden_size": 128,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1, 2],
        }
    return config_cls(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_processor(arch: str = "qwen2-vl") -> Any:
    """The processor (tokenizer + image/video processors + chat template) for ``arch``."""
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    _check_arch(arch)
    if arch.startswith("qwen3-vl"):
        # Qwen3-VL: 16-pixel patches, and a video budget over all frames together (up to 64 frames of
        # 224x224 fit, so the tiny model's frame size does not depend on the clip length there).
        vision: dict[str, Any] = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
        half = [0.5, 0.5, 0.5]  # the real Qwen3-VL processors normalise with mean = std = 0.5
        image_processor = Qwen2VLImageProcessor(
            min_pixels=64 * 64, max_pixels=_MAX_IMAGE_PIXELS, image_mean=half, image_std=half, **vision
        )
        video_processor = Qwen3VLVideoProcessor(
            size={"shortest_edge": 2 * 64 * 64, "longest_edge": 64 * _MAX_VIDEO_PIXELS},
            cap_pixels_per_frame=False,
            **vision,
        )
        return Qwen3VLProcessor(
            image_processor=image_processor,
            tokenizer=build_tokenizer(),
            video_processor=video_processor,
            chat_template=QWEN3_CHAT_TEMPLATE,
        )
    vision = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    image_processor = Qwen2VLImageProcessor(min_pixels=_MIN_PIXELS, max_pixels=_MAX_IMAGE_PIXELS, **vision)
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=_MIN_PIXELS, max_pixels=_MAX_VIDEO_PIXELS, cap_pixels_per_frame=False, **vision
    )
    processor_cls: Any = Qwen2VLProcessor if arch == "qwen2-vl" else Qwen2_5_VLProcessor
    return processor_cls(
        image_processor=image_processor,
        tokenizer=build_tokenizer(),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def _check_arch(arch: str) -> None:
    if arch not in TINY_MODEL_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_MODEL_ARCHS}")


def _save_model(arch: str, tokenizer: Any, out: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    config = _build_config(arch, tokenizer)
    model_cls: Any = {
        "qwen2-vl": Qwen2VLForConditionalGeneration,
        "qwen2.5-vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3-vl": Qwen3VLForConditionalGeneration,
        "qwen3-vl-moe": Qwen3VLMoeForConditionalGeneration,
    }[arch]
    old_dtype = torch.get_default_dtype()
    # Leave the caller's global RNG and default dtype untouched.
    with torch.random.fork_rng(devices=[]):
        torch.set_default_dtype(torch.float32)
        try:
            torch.manual_seed(_SEED)
            model = model_cls(config).eval()
        finally:
            torch.set_default_dtype(old_dtype)
    im_end, endoftext = config.text_config.eos_token_id, config.text_config.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` onto ``out``, moving an existing checkpoint aside first."""
    for _ in range(5):
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty directory
            return
        except OSError:
            if not out.exists():
                raise
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex}")
        try:
            os.rename(out, old)
        except FileNotFoundError:  # a concurrent writer moved it aside already
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    raise OSError(f"could not move the generated checkpoint into place at {out}")


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2-vl") -> Path:
    """Generate a tiny random ``arch`` checkpoint (Hugging Face format) into ``out_dir`` and return it.

    Fully offline and deterministic: the same ``arch`` always yields byte-identical files. The checkpoint is
    assembled in a temporary sibling directory and renamed into place, so readers never see a partial one;
    an existing ``out_dir`` is replaced.
    """
    _check_arch(arch)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        processor = build_processor(arch)
        processor.save_pretrained(tmp)
        _save_model(arch, processor.tokenizer, tmp)
        # mkdtemp (and safetensors) create owner-only entries; use ordinary checkpoint permissions.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
