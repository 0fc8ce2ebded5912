"""The thin layer that talks to ``torch.distributed``: groups, the DDP hook, small collectives."""
