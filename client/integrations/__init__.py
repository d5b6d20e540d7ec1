"""ckptd where other frameworks already keep their checkpoints: Hugging Face
safetensors (``ckptd.client.integrations.safetensors``), Lightning and torchft.

Each integration is its own module or package and needs its own optional
extra (``pip install 'ckptd[safetensors]'``); nothing here is imported until a
user, or a ``ckptd`` command, asks for it, and the core (``ckptd/``) never
imports this package.
"""
