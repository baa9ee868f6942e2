"""The chunked PyTorch tier: any device, autograd through PyTorch."""
