"""Exchange codecs: what a worker's values look like on the wire.

A codec turns a flat float32 buffer, shape (n_local, L) with one row per local worker, into its
wire form (a dict of arrays, each with the same leading worker axis) and back. `summable` codecs
are plain floating-point casts that the ring's all-reduce can add as they are; the others
(quantized) are exchanged with a quantized ring or an all-gather (see comm.py), and every sum is
taken in float32 after decoding.

    fp32                            the values as they are
    fp16 (default)                  a cast of x / unit; in an exchange every worker uses the same
                                    unit (comm.py shares it), so the cast stays summable
    bf16                            a cast of x (float32's exponent range: no unit needed)
    int8, int4, int2                group-wise affine: `bits`-bit integers, an fp16 scale and bias
                                    per group of x / unit
    e3m0                            Streaming DiLoCo's 4-bit float: sign and 3 exponent bits, no
                                    mantissa (0 or +-scale * 2^-k, k = 0..6), fp16 scale per group

Scale invariance: every fp16 or quantized message (one worker's row) carries its `unit`, a float32
power of two that puts its largest magnitude in [2^13, 2^14). Dividing by it is exact, and fp16
holds x / unit and the group scales of it without underflow or overflow whatever the size of x:
the error of a round trip does not depend on the scale of its input, and finite values stay finite.

Rounding (the quantized codecs): `nearest`, or `stochastic` (round up with probability equal to
the distance from the level below, so the decoded values are unbiased). The random numbers are
a hash of the value, its position and the worker: the same message always rounds the
same way (a resumed run repeats it; the simulator and a real ring agree), and values that differ
round independently. A plain name (`int4`, `e3m0`) takes the codec's default rounding
(DEFAULT_ROUNDING: measured); `int4-nearest` and `int4-stochastic` pick one.

`wire_bytes(L)` is what one worker's payload of L values really takes on the wire, scales and
unit included; the byte accounting and the network model both use it.
"""

import mlx.core as mx

from ..options import ConfigError

GROUP = 128  # values per quantization group: fp16 scale (and bias) cost 2-4 bytes per 128 values
UNIT_BYTES = 4  # one float32 power of two per message
CHECK_BYTES = 12  # per worker before every exchange (comm.py): its largest magnitude, a non-finite flag, its arrival, float32
TOP = 14        # a message's largest |x / unit| lies in [2^(TOP - 1), 2^TOP): fp16 holds it, and sums of it, with room
ROUNDINGS = ("nearest", "stochastic")
# Each quantized codec's default rounding, from Streaming DiLoCo runs (`python bench/streaming.py`: small
# GPT, 4 workers, P = 4, tau = 1, 500 steps, one seed; final eval loss nearest / stochastic): int4 4.2105
# / 4.2115, equal, so nearest (1.4x lower error per message); e3m0 4.2241 / 4.2126 and int2 4.2132 /
# 4.2060, stochastic: to the nearest level their mean |x| decodes 3.3% and 11% low. int8: nearest
# (biased by 0.01%).
DEFAULT_ROUNDING = {"int8": "nearest", "int4": "nearest", "e3m0": "stochastic", "int2": "stochastic"}


def _pad_to_group(x):
    """(n, L) -> (n, L') with L' a multiple of GROUP (zeros appended)."""
    pad = (-x.shape[-1]) % GROUP
    return mx.pad(x, [(0, 0), (0, pad)]) if pad else x


def unit_of(top: mx.array) -> mx.array:
    """The power of two that puts a largest magnitude `top` (any shape) in [2^(TOP-1), 2^TOP).
    Clipped to float32's normal powers (zero, or a value below 1e-38, gets the smallest)."""
    exponent = mx.floor(mx.log2(mx.maximum(top, 1e-45))) + 1 - TOP
    return mx.power(2.0, mx.clip(exponent, -126, 127 - TOP))


def largest_magnitude(x: mx.array) -> mx.array:
    """(n, L) -> (n, 1): each row's largest finite magnitude."""
    return mx.max(mx.where(mx.isfinite(x), mx.abs(x), 0.0), axis=-1, keepdims=True)


def uniform(x: mx.array, salt) -> mx.array:
    """Pseudo-random numbers in [0, 1), one per value of x (n, ...), from a hash (murmur3's
    finaliser) of the value's bits, its position and its row's salt (the worker's index)."""
    n = x.shape[0]
    salt = mx.zeros((n,), mx.uint32) if salt is None else mx.array(salt).astype(mx.uint32)
    position = mx.arange(x.size // n, dtype=mx.uint32).reshape(1, *x.shape[1:])
    h = x.astype(mx.float32).view(mx.uint32) ^ (position * 0x9E3779B9)
    h = h ^ (salt.reshape(n, *[1] * (x.ndim - 1)) * 0x85EBCA6B)
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * multiplier
    h = h ^ (h >> 16)
    return (h >> 8).astype(mx.float32) * 2.0 ** -24


class Codec:
    name = "base"
    summable = False
    shared_unit_bytes = 0  # of wire_bytes: the unit, which a summed exchange shares through the check

    def encode(self, x: mx.array, salt=None) -> dict:
        """Wire form of (n, L) float32 values; `salt` (n job-wide worker indices) seeds rounding."""
        raise NotImplementedError

    def decode(self, wire: dict, length: int = None) -> mx.array:
        """The float32 values, shape (n, length), of a wire form; without `length`, every value it
        holds (a quantized codec's padding to whole groups included). A sum over the rows takes them
        all and slices after: MLX's CPU reduction over the first axis of a sliced (strided) array is
        ~85x slower than over a contiguous one (164 against 1.9 ms for 2 x 4.7M values)."""
        raise NotImplementedError

    def wire_bytes(self, length: int) -> int:
        """Bytes of one worker's wire form of `length` values (what encode really produces)."""
        raise NotImplementedError

    def roundtrip(self, x: mx.array, salt=None) -> mx.array:
        return self.decode(self.encode(x, salt), x.shape[-1])


class Cast(Codec):
    summable = True

    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype
        # only fp16 needs a unit: fp32 and bf16 have float32's exponent range
        self.shared_unit_bytes = UNIT_BYTES if dtype == mx.float16 else 0

    def encode(self, x, salt=None, unit=None):
        """`unit` (n, 1): the power of two to divide by (comm.py passes one shared by all workers)."""
        if not self.shared_unit_bytes:
            return {"values": x.astype(self.dtype)}
        unit = unit_of(largest_magnitude(x)) if unit is None else unit
        return {"unit": unit, "values": (x / unit).astype(self.dtype)}

    def decode(self, wire, length=None):
        values = wire["values"].astype(mx.float32)
        return values * wire["unit"] if "unit" in wire else values

    def wire_bytes(self, length):
        return length * self.dtype.size + self.shared_unit_bytes


class Quantized(Codec):
    """Groups of GROUP values of x / unit, each with an fp16 scale, as `bits`-bit codes packed the way
    mx.dequantize reads them; `rounding` nearest or stochastic."""

    def __init__(self, rounding: str = "nearest"):
        self.rounding = rounding

    def groups(self, x):
        """(n, L) -> the unit (n, 1) and the values over it, (n, groups, GROUP)."""
        unit = unit_of(largest_magnitude(x))
        return unit, (_pad_to_group(x) / unit).reshape(x.shape[0], -1, GROUP)

    def round_up(self, fraction, x, salt):
        """Where a value a `fraction` of the way from its level below to the next rounds up."""
        if self.rounding == "stochastic":
            return uniform(x, salt) < fraction
        return fraction >= 0.5

    def pack(self, codes):
        """(n, groups, GROUP) integers below 2^bits -> (n, groups * GROUP * bits / 32) uint32."""
        per_word = 32 // self.bits
        shifts = mx.arange(per_word, dtype=mx.uint32) * self.bits
        words = codes.astype(mx.uint32).reshape(codes.shape[0], -1, per_word) << shifts
        return words.sum(axis=-1).astype(mx.uint32)  # disjoint bit fields: the sum is their OR

    def unpack(self, words):
        """`pack` undone: (n, groups, GROUP) uint8, read a byte at a time (a word's bytes are its
        lowest bits first): smaller temporaries than shifting uint32 words (mx.dequantize's CPU path);
        int4's decode of 2 x 4.7M values takes 23 ms against 31 (bench/codec_speed.py)."""
        per_byte, mask = 8 // self.bits, (1 << self.bits) - 1
        octets = words.view(mx.uint8)
        codes = mx.stack([(octets >> (k * self.bits)) & mask for k in range(per_byte)], axis=-1)
        return codes.reshape(words.shape[0], -1, GROUP)

    @staticmethod
    def values(x, unit, length):
        """(n, groups, GROUP) float32 of x / unit -> (n, length) values (all of them without `length`)."""
        x = x.reshape(x.shape[0], -1) * unit
        return x if length is None else x[:, :length]

    def wire_bytes(self, length):
        groups = -(-length // GROUP)
        return UNIT_BYTES + groups * (GROUP * self.bits // 8 + 2 * self.scales_per_group)


class Affine(Quantized):
    """`bits`-bit integers q with an fp16 scale s and bias b per group: a value is b + q * s."""
    scales_per_group = 2

    def __init__(self, name, bits, rounding="nearest"):
        super().__init__(rounding)
        self.name, self.bits = name, bits

    def grid(self, g):
        """Each group's fp16 scale s and bias b: its levels are b + q s, q = 0 .. 2^bits - 1, zero
        one of them. Stochastic rounding takes levels that reach both of the group's extremes
        (`covering_grid`): a value beyond the last level cannot round to itself on average. Nearest
        rounding, which is biased anyway, takes mx.quantize's finer ones (`quantize_grid`), and so
        does int2, whose three steps cannot spare one (issue 39, docs/strategies.md: covering levels
        cost int2 1.7x the error of a message and 0.5% of Streaming DiLoCo's loss, and error
        feedback on them ends 1.5x to 92x worse than none at M = 3 to 8)."""
        covering = self.rounding == "stochastic" and self.bits > 2
        return self.covering_grid(g) if covering else self.quantize_grid(g)

    def quantize_grid(self, g):
        """As mx.quantize picks them: the range over 2^bits - 1 steps, from the extreme of larger
        magnitude (the bias), adjusted so that zero is a level; when that rounds the step down, the
        levels stop short of the other extreme, and its tail is clipped (issue 39: int2 clips 8% of
        normal values, so even stochastic rounding decodes their mean |x| 4% low; int4 0.15%).
        Not mx.quantize itself: it has no stochastic mode, and its nearest codes differ (it rounds
        with the float32 scale, not the fp16 one sent; fp16 scales need fp16 input, which loses
        bits of x / unit; its smallest step, 1e-7, gives constant groups a nonzero scale)."""
        low, high = mx.min(g, axis=-1, keepdims=True), mx.max(g, axis=-1, keepdims=True)
        from_low = mx.abs(low) > mx.abs(high)
        step = mx.maximum((high - low) / (2 ** self.bits - 1), 1e-30)
        step, edge = mx.where(from_low, step, -step), mx.where(from_low, low, high)
        zero_at = mx.round(edge / step)
        scale = mx.where(zero_at != 0, edge / mx.where(zero_at != 0, zero_at, 1), step)
        return scale.astype(mx.float16), mx.where(zero_at == 0, 0.0, edge).astype(mx.float16)

    def covering_grid(self, g):
        """The smallest step s whose levels -z s .. (2^bits - 1 - z) s reach from the group's
        smallest value to its largest, z steps below zero (z: the floor or the ceiling of where
        zero lies in the range). Nothing is clipped, and zero is a level, so no value rounds across
        it: stochastic rounding keeps each value's mean and its mean |x|. The price is a coarser
        step: int4's error per message is 4% larger than on `quantize_grid`'s levels, int2's
        (whose step would reach the largest |x|, against half of it) 1.7x."""
        levels = 2 ** self.bits - 1
        low = mx.minimum(mx.min(g, axis=-1, keepdims=True), 0.0)
        high = mx.maximum(mx.max(g, axis=-1, keepdims=True), 0.0)
        where_zero = levels * -low / mx.maximum(high - low, 1e-30)

        def step_for(z):
            to_high = mx.where(high > 0, high / (levels - z), 0.0)  # inf where z == levels
            to_low = mx.where(low < 0, -low / z, 0.0)
            return mx.maximum(to_high, to_low)

        down, up = mx.floor(where_zero), mx.ceil(where_zero)
        z = mx.where(step_for(down) <= step_for(up), down, up)
        # fp16 rounds to nearest: from 2^-10 above, the levels still reach both extremes
        scale = (step_for(z) * (1 + 2 ** -10)).astype(mx.float16)
        return scale, (-z * scale.astype(mx.float32)).astype(mx.float16)

    def encode(self, x, salt=None):
        unit, g = self.groups(x)
        levels = 2 ** self.bits - 1
        scale, bias = self.grid(g)
        scale32 = scale.astype(mx.float32)
        steps = (g - bias.astype(mx.float32)) / mx.where(scale32 == 0, 1.0, scale32)
        q = mx.floor(steps)
        q = mx.clip(q + self.round_up(steps - q, g, salt), 0, levels)  # q or q + 1 (faster than mx.where)
        n = x.shape[0]
        return {"unit": unit, "q": self.pack(q), "scales": scale.reshape(n, -1), "biases": bias.reshape(n, -1)}

    def decode(self, wire, length=None):
        """b + q s as mx.dequantize computes it (the same float32 values), a byte at a time (`unpack`)."""
        scales, biases = (wire[k].astype(mx.float32)[..., None] for k in ("scales", "biases"))
        return self.values(self.unpack(wire["q"]).astype(mx.float32) * scales + biases, wire["unit"], length)


class E3M0(Quantized):
    """Sign and a 3-bit exponent: code 0 is zero, code c in 1..7 is scale * 2^-(c-1), where scale is
    the group's largest magnitude. Between two levels a value rounds to the one `rounding` picks
    (nearest: up from halfway between them, e.g. 0.74 to 0.5 and 0.75 to 1.0); two codes a byte."""
    name = "e3m0"
    bits = 4
    LEVELS = 7
    scales_per_group = 1

    def encode(self, x, salt=None):
        unit, g = self.groups(x)
        scale = mx.max(mx.abs(g), axis=-1, keepdims=True).astype(mx.float16)
        v = mx.minimum(mx.abs(g) / mx.maximum(scale.astype(mx.float32), 1e-30), 1.0)   # in [0, 1]
        # the level below v: 2^-k with k = ceil(-log2 v), or zero below 2^-(LEVELS-1) (k = LEVELS)
        k = mx.clip(mx.ceil(-mx.log2(mx.maximum(v, 1e-30))), 0, self.LEVELS)
        below = mx.where(k == self.LEVELS, 0.0, mx.power(2.0, -k))
        above = mx.where(k == self.LEVELS, 2.0 ** (1 - self.LEVELS), 2 * below)
        fraction = mx.where(k == 0, 0.0, (v - below) / (above - below))
        k = k - self.round_up(fraction, g, salt)
        code = mx.where(k == self.LEVELS, 0, k + 1) + 8 * (g < 0)  # bit 3: the sign
        return {"unit": unit, "codes": self.pack(code), "scales": scale.reshape(x.shape[0], -1)}

    @staticmethod
    def levels(code: mx.array) -> mx.array:
        """Each code's value at scale 1."""
        magnitude = code & 7
        value = mx.where(magnitude == 0, 0.0, mx.power(2.0, 1.0 - magnitude.astype(mx.float32)))
        return mx.where((code >> 3) == 1, -value, value)

    def decode(self, wire, length=None):
        # looked up in the 16 codes' values: twice as fast as each one's power of two (bench/codec_speed.py)
        value = mx.take(self.levels(mx.arange(16)), self.unpack(wire["codes"])) * wire["scales"].astype(mx.float32)[..., None]
        return self.values(value, wire["unit"], length)


def _quantized(name: str, rounding: str, label: str = None):
    codec = E3M0(rounding) if name == "e3m0" else Affine(name, {"int8": 8, "int4": 4, "int2": 2}[name], rounding)
    codec.name = label or name
    return codec


CASTS = (Cast("fp32", mx.float32), Cast("fp16", mx.float16), Cast("bf16", mx.bfloat16))
CODECS = {c.name: c for c in CASTS} | {n: _quantized(n, r) for n, r in DEFAULT_ROUNDING.items()}
VARIANTS = {f"{n}-{r}": _quantized(n, r, f"{n}-{r}") for n in DEFAULT_ROUNDING for r in ROUNDINGS}  # int4-nearest, ...


def get_codec(name: str) -> Codec:
    codec = CODECS.get(name) or VARIANTS.get(name)
    if codec is None:
        raise ConfigError(f"unknown codec '{name}'; choose one of {', '.join(CODECS)} "
                          f"(the quantized ones also as e.g. int4-nearest or int4-stochastic)")
    return codec
