"""An Endpoint Picker for the Gateway API Inference Extension (``radixcache[epp]``).

Envoy's ``ext_proc`` filter sends each request to the picker, which reads its OpenAI body,
tokenizes it as the engine does (``ChatTokenizer``: the model's ``tokenizer.json`` and chat
template), ranks the pool's endpoints with radixcache's event-fed router index, and answers with
the ``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata (an ordered list, so
that the gateway can fall back). See the "Endpoint picker" page of the documentation.

Modules: ``tokenization`` (``ChatTokenizer``), ``openai`` (``RequestReader``: bodies into
token ids), ``picking`` (the ``Picker`` interface and ``Pick``), ``local_index``
(``LocalIndexPicker``: the ``Picker`` over a ``Router`` fed by the engines' ZeroMQ events),
``extproc`` (the gRPC server: ext_proc and health), ``metrics`` (Prometheus), ``args`` and
``__main__`` (``python -m radixcache.picker``). Importing this package imports none of gRPC,
the Envoy types, ``tokenizers`` or Jinja2: the modules that need them import them when used.
"""

from .local_index import EndpointSpec, LocalIndexPicker
from .openai import PromptRequest, RequestError, RequestReader
from .picking import Pick, Picker
from .tokenization import ChatTokenizer, TemplateError

__all__ = ["ChatTokenizer", "EndpointSpec", "LocalIndexPicker", "Pick", "Picker",
           "PromptRequest", "RequestError", "RequestReader", "TemplateError"]
