"""Operations on real PyTorch objects: signal collection, parameter lists, checkpoint files, AMP."""
