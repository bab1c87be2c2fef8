"""An Endpoint Picker for the Gateway API Inference Extension (``radixcache[epp]``), run by
``radixcache serve --epp PORT``.

Envoy's ``ext_proc`` filter sends each request to the picker, which reads its OpenAI body,
tokenizes it as the engine does (``ChatTokenizer``: the model's ``tokenizer.json`` and chat
template), ranks the registered instances with the index service's routing (its event-fed
indexes, its load table), and answers with the ``x-gateway-destination-endpoint`` header and
``envoy.lb`` metadata (an ordered list, so that the gateway can fall back). See the "Endpoint
picker" page of the documentation.

Modules: ``tokenization`` (``ChatTokenizer``), ``openai`` (``RequestReader``: bodies into
token ids), ``picking`` (the ``Picker`` interface and ``Pick``), ``service_picker``
(``ServicePicker``: the ``Picker`` over the service's ``IndexService``), ``extproc`` (the
gRPC server: ext_proc and health) and ``metrics`` (Prometheus, in the service's registry).
Importing this package imports none of gRPC, the Envoy types, ``tokenizers`` or Jinja2: the
modules that need them import them when used.
"""

from .openai import PromptRequest, RequestError, RequestReader
from .picking import Pick, Picker
from .service_picker import ServicePicker
from .tokenization import ChatTokenizer, TemplateError

__all__ = ["ChatTokenizer", "Pick", "Picker", "PromptRequest", "RequestError", "RequestReader",
           "ServicePicker", "TemplateError"]
