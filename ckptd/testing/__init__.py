"""Test support that ships with ckptd: the store conformance suite
(``ckptd.testing.store_conformance``, needs pytest), fault-injecting stores
(``ckptd.testing.faults``), and moto's S3 server with S3's atomic conditional
writes (``ckptd.testing.moto_s3``, needs moto; the local cluster script runs it)."""
