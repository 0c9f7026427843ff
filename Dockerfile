# fedpilot's scheduler and GPU workers (docker-compose services `scheduler` and `worker`): `fedpilot ARGS`.
FROM python:3.11-slim

# PyPI's Linux wheel of torch ships its CUDA libraries; the GPU itself comes from the compose reservation.
RUN pip install --no-cache-dir torch==2.13.0

WORKDIR /opt/fedpilot
COPY pyproject.toml README.md ./
COPY platform platform
COPY configs configs
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 1000 fedpilot \
    && mkdir -p /cache && chown fedpilot:fedpilot /cache
USER fedpilot
WORKDIR /home/fedpilot

ENV FEDPILOT_CACHE=/cache \
    MLFLOW_DISABLE_TELEMETRY=true
VOLUME ["/cache"]
ENTRYPOINT ["fedpilot"]
CMD ["worker"]
