# syntax=docker/dockerfile:1.7
# The operator and API image: spec models, planner, kopf operator, FastAPI service.
# No torch, no DeepSpeed (the `runtime` extra is not installed), so it stays ~250 MB.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/spillway/spillway:0.1.0 .
#
# Build context: the repository root. docker/operator.Dockerfile.dockerignore keeps
# runs/, tests and caches out of it. Pin the base by digest in CI
# (`docker buildx imagetools inspect python:3.12.11-slim-bookworm`).

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

# ---- build: wheels for the project and its pinned dependencies -------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependencies first, code last, so that a code change rebuilds no dependency layer.
# requirements.lock pins every transitive version; the extras choose which apply.
COPY pyproject.toml requirements.lock ./
RUN python -m venv /opt/spillway \
 && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['operator'] + p['optional-dependencies']['api']))" \
      > requirements.txt \
 && /opt/spillway/bin/pip install --constraint requirements.lock -r requirements.txt
COPY README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY api/ api/
RUN /opt/spillway/bin/pip install --no-deps --constraint requirements.lock . \
 && /opt/spillway/bin/pip uninstall --yes pip setuptools wheel

# ---- final: the venv on a clean base, as an unprivileged user ---------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="spillway" \
      org.opencontainers.image.description="Spillway operator and API (no torch)" \
      org.opencontainers.image.source="https://github.com/spillway/spillway" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 1000 spillway \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /var/lib/spillway --shell /usr/sbin/nologin spillway \
 && install -d -o 1000 -g 1000 /var/lib/spillway
COPY --from=build /opt/spillway /opt/spillway
ENV PATH=/opt/spillway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPILLWAY_DATA_DIR=/var/lib/spillway
WORKDIR /var/lib/spillway
# Numeric UID so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 1000:1000
EXPOSE 8080 8081
ENTRYPOINT ["spillway"]
CMD ["--help"]
