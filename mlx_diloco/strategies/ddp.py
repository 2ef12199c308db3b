"""Data parallel: gradients averaged across workers at every step, so replicas stay equal."""

from dataclasses import dataclass

from .base import Strategy, codec_label, mean_gradients, option


@dataclass
class DDP(Strategy):
    name = "ddp"
    compress: str = option("fp16", "codec of the averaged gradients")

    def check(self):
        from ..exchange.codecs import get_codec
        get_codec(self.compress)


    def label_options(self) -> list:
        return super().label_options() + codec_label(self.compress)
    def reduce_gradients(self, grads, step):
        return mean_gradients(self.comm, grads, self.compress)
