# GPU image for specdraft (stub: the infra issue fills in compose/cluster wiring).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/specdraft
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
COPY pyproject.toml constraints.txt README.md ./
COPY specdraft ./specdraft
COPY pipelines ./pipelines
COPY flows ./flows
COPY configs ./configs
# Same install as the README, with the CUDA build of torch and the gpu extra.
RUN pip install torch==2.13.0 && pip install -c constraints.txt -e ".[gpu]"
ENTRYPOINT ["specdraft"]
