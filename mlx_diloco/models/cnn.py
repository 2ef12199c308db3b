"""A small convolutional network for 28x28 grey images (Fashion-MNIST)."""

from dataclasses import dataclass, field

import mlx.nn as nn

from ..options import from_dict


@dataclass
class CNNArgs:
    image_size: int = 28
    in_channels: int = 1
    channels: list = field(default_factory=lambda: [32, 64])
    hidden: int = 128
    num_classes: int = 10

    @classmethod
    def from_dict(cls, params):
        return from_dict(cls, params, what="CNN model option")


def max_pool_2x2(x):
    # nn.MaxPool2d uses as_strided, which mx.vmap cannot batch; a reshape can.
    B, H, W, C = x.shape
    return x.reshape(B, H // 2, 2, W // 2, 2, C).max(axis=(2, 4))


class CNN(nn.Module):
    def __init__(self, args: CNNArgs):
        super().__init__()
        convs, c_in = [], args.in_channels
        for c_out in args.channels:
            convs.append(nn.Conv2d(c_in, c_out, kernel_size=3, padding=1))
            c_in = c_out
        self.convs = convs
        side = args.image_size // 2 ** len(args.channels)
        self.fc1 = nn.Linear(c_in * side * side, args.hidden)
        self.fc2 = nn.Linear(args.hidden, args.num_classes)

    def __call__(self, x):  # x: (B, H, W, C)
        for conv in self.convs:
            x = max_pool_2x2(nn.relu(conv(x)))
        x = x.reshape(x.shape[0], -1)
        return self.fc2(nn.relu(self.fc1(x)))
