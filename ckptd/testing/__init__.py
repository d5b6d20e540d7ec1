"""Test support that ships with ckptd: the store conformance suite
(``ckptd.testing.store_conformance``, needs pytest) and fault-injecting stores
(``ckptd.testing.faults``)."""
