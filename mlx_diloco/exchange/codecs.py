"""Exchange codecs: what a worker's values look like on the wire.

A codec turns a flat float32 buffer, shape (n_local, L) with one row per local worker, into its
wire form (a dict of arrays, each with the same leading worker axis) and back. `summable` codecs
are plain floating-point casts that the ring's all-reduce can add as they are; the others
(quantized) are exchanged with a quantized ring or an all-gather (see comm.py), and every sum is
taken in float32 after decoding.

    fp32, fp16 (default), bf16      casts; fp16 and bf16 sums are scaled by 1/M first
    int8, int4, int2                group-wise affine (mx.quantize), fp16 scale and bias per group
    e3m0                            Streaming DiLoCo's 4-bit float: sign and 3 exponent bits, no
                                    mantissa (0 or +-scale * 2^-k, k = 0..6), fp16 scale per group

`wire_bytes(L)` is what one worker's payload of L values really takes on the wire, scales
included; the byte accounting and the network model both use it.
"""

import mlx.core as mx

GROUP = 128  # values per quantization group: fp16 scale (and bias) cost 2-4 bytes per 128 values


def _pad_to_group(x):
    """(n, L) -> (n, L') with L' a multiple of GROUP (zeros appended)."""
    pad = (-x.shape[-1]) % GROUP
    return mx.pad(x, [(0, 0), (0, pad)]) if pad else x


class Codec:
    name = "base"
    summable = False

    def encode(self, x: mx.array) -> dict:
        raise NotImplementedError

    def decode(self, wire: dict, length: int) -> mx.array:
        """The float32 values, shape (n, length), of a wire form."""
        raise NotImplementedError

    def wire_bytes(self, length: int) -> int:
        """Bytes of one worker's wire form of `length` values (what encode really produces)."""
        raise NotImplementedError

    def roundtrip(self, x: mx.array) -> mx.array:
        return self.decode(self.encode(x), x.shape[-1])


class Cast(Codec):
    summable = True

    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype

    def encode(self, x):
        return {"values": x.astype(self.dtype)}

    def decode(self, wire, length):
        return wire["values"].astype(mx.float32)

    def wire_bytes(self, length):
        return length * self.dtype.size


class Affine(Codec):
    """mx.quantize: `bits`-bit integers with a scale and a bias per group of GROUP values."""

    def __init__(self, name, bits):
        self.name, self.bits = name, bits

    def wire_bytes(self, length):
        groups = -(-length // GROUP)
        return groups * (GROUP * self.bits // 8 + 2 * 2)  # packed values, fp16 scale and bias

    def encode(self, x):
        n = x.shape[0]
        groups = _pad_to_group(x).astype(mx.float16).reshape(-1, GROUP)
        q, scales, biases = mx.quantize(groups, group_size=GROUP, bits=self.bits)
        return {"q": q.reshape(n, -1), "scales": scales.reshape(n, -1), "biases": biases.reshape(n, -1)}

    def decode(self, wire, length):
        n = wire["q"].shape[0]
        q = wire["q"].reshape(-1, GROUP * self.bits // 32)
        x = mx.dequantize(q, wire["scales"].reshape(-1, 1), wire["biases"].reshape(-1, 1),
                          group_size=GROUP, bits=self.bits)
        return x.reshape(n, -1)[:, :length].astype(mx.float32)


class E3M0(Codec):
    """Sign and a 3-bit exponent: code 0 is zero, code c in 1..7 is scale * 2^-(c-1), where scale is
    the group's largest magnitude. Rounded to the nearest representable value; two codes a byte."""
    name = "e3m0"
    LEVELS = 7

    def wire_bytes(self, length):
        groups = -(-length // GROUP)
        return groups * (GROUP // 2 + 2)  # two codes a byte, fp16 scale

    def encode(self, x):
        n = x.shape[0]
        groups = _pad_to_group(x).reshape(n, -1, GROUP)
        scale = mx.max(mx.abs(groups), axis=-1, keepdims=True).astype(mx.float16)
        v = mx.abs(groups) / mx.maximum(scale.astype(mx.float32), 1e-30)   # in [0, 1]
        # nearest of 2^-k: v >= 0.75 * 2^-k rounds up to 2^-k, i.e. k = floor(log2(0.75 / v)) + 1
        k = mx.floor(mx.log2(0.75 / mx.maximum(v, 1e-30))) + 1
        code = mx.where(v < 2.0 ** -self.LEVELS, 0, mx.clip(k, 0, self.LEVELS - 1) + 1).astype(mx.uint8)
        code = code | (groups < 0).astype(mx.uint8) << 3
        pairs = code.reshape(n, -1, 2)
        return {"codes": pairs[..., 0] | (pairs[..., 1] << 4), "scales": scale.reshape(n, -1)}

    def decode(self, wire, length):
        packed = wire["codes"]
        n = packed.shape[0]
        code = mx.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1, GROUP)
        magnitude = code & 7
        value = mx.where(magnitude == 0, 0.0, mx.power(2.0, 1.0 - magnitude.astype(mx.float32)))
        value = mx.where((code >> 3) == 1, -value, value) * wire["scales"].astype(mx.float32)[..., None]
        return value.reshape(n, -1)[:, :length]


CODECS = {c.name: c for c in (
    Cast("fp32", mx.float32), Cast("fp16", mx.float16), Cast("bf16", mx.bfloat16),
    Affine("int8", 8), Affine("int4", 4), E3M0(), Affine("int2", 2),
)}


def get_codec(name: str) -> Codec:
    from ..config import ConfigError
    if name not in CODECS:
        raise ConfigError(f"unknown codec '{name}'; choose one of {', '.join(CODECS)}")
    return CODECS[name]
