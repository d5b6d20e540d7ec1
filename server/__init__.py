"""The FastAPI face of a ckptd repository (installed as ``ckptd.server``).

``create_app(settings)`` builds the application; ``run(settings)`` serves it with
uvicorn. The routes are a thin layer over ``ckptd.repository.Repository``."""
