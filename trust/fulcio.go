package trust

import (
	"bytes"
	"crypto/x509"
	"encoding/asn1"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
)

// Fulcio is a sigstoreSigned requirement's "fulcio": the CA that issues
// signing certificates, and the identity a certificate must name.
type Fulcio struct {
	// CAName is where the CA came from: a file, or "fulcio.caData".
	CAName string
	Roots  *x509.CertPool
	// OIDCIssuer is the identity provider that vouched for the signer;
	// SubjectEmail the signer's email it vouched for.
	OIDCIssuer   string
	SubjectEmail string
}

// Fulcio's certificate extensions naming the OIDC issuer: v1 holds the
// raw string, v2 a DER UTF8String.
var (
	oidIssuerV1 = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 57264, 1, 1}
	oidIssuerV2 = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 57264, 1, 8}
)

// parseFulcio reads a requirement's "fulcio" object and its CA.
func parseFulcio(data json.RawMessage, fail failFunc, seen func(string)) (*Fulcio, error) {
	var raw struct {
		CAPath       string `json:"caPath"`
		CAData       string `json:"caData"`
		OIDCIssuer   string `json:"oidcIssuer"`
		SubjectEmail string `json:"subjectEmail"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, fail("fulcio", "not an object of caPath or caData, oidcIssuer and subjectEmail: %v", err)
	}
	var src pemSource
	switch {
	case (raw.CAPath == "") == (raw.CAData == ""):
		return nil, fail("fulcio", "exactly one of caPath and caData must be set")
	case raw.CAPath != "":
		src = pemSource{key: "fulcio.caPath " + raw.CAPath, name: raw.CAPath, path: raw.CAPath}
	default:
		src = pemSource{key: "fulcio.caData", name: "fulcio.caData", data: raw.CAData}
	}
	if raw.OIDCIssuer == "" {
		return nil, fail("fulcio.oidcIssuer", "missing: the OIDC issuer a certificate must name")
	}
	if raw.SubjectEmail == "" {
		return nil, fail("fulcio.subjectEmail", "missing: the email a certificate must name")
	}
	b, err := src.read(fail, seen)
	if err != nil {
		return nil, err
	}
	certs, err := cryptoutils.UnmarshalCertificatesFromPEM(b)
	if err != nil {
		return nil, fail(src.key, "not PEM certificates: %v", err)
	}
	if len(certs) == 0 {
		return nil, fail(src.key, "no PEM certificate")
	}
	roots := x509.NewCertPool()
	for _, c := range certs {
		roots.AddCert(c)
	}
	return &Fulcio{CAName: src.name, Roots: roots, OIDCIssuer: raw.OIDCIssuer, SubjectEmail: raw.SubjectEmail}, nil
}

// parseLeaf is the one certificate of a signature's certificate
// annotation.
func parseLeaf(certPEM string) (*x509.Certificate, error) {
	certs, err := cryptoutils.UnmarshalCertificatesFromPEM([]byte(certPEM))
	if err != nil {
		return nil, fmt.Errorf("bad Fulcio certificate: %v", err)
	}
	if len(certs) != 1 {
		return nil, fmt.Errorf("bad Fulcio certificate: %d certificates in %s, want 1", len(certs), CertificateAnnotation)
	}
	return certs[0], nil
}

// verify checks that leaf, a signature's certificate, was issued by the
// CA (through the intermediates of chainPEM, which may be empty) for code
// signing, was valid at the time at which Rekor logged the signature, and
// names the OIDC issuer and the email f requires.
func (f *Fulcio) verify(leaf *x509.Certificate, chainPEM string, at time.Time) error {
	if at.Before(leaf.NotBefore) || at.After(leaf.NotAfter) {
		return fmt.Errorf("certificate not valid when Rekor logged the signature (%s): valid from %s to %s",
			at.UTC().Format(time.RFC3339), leaf.NotBefore.UTC().Format(time.RFC3339), leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	intermediates := x509.NewCertPool()
	if chainPEM != "" {
		chain, err := cryptoutils.UnmarshalCertificatesFromPEM([]byte(chainPEM))
		if err != nil {
			return fmt.Errorf("bad certificate chain: %v", err)
		}
		// The chain ends with Fulcio's root: as an intermediate it can
		// lead to a root of the CA file, never stand for one.
		for _, c := range chain {
			intermediates.AddCert(c)
		}
	}
	// Go refuses a critical SAN extension holding no name it parses
	// (Fulcio may issue one with only an otherName); the email is
	// matched below.
	leaf.UnhandledCriticalExtensions = slices.DeleteFunc(leaf.UnhandledCriticalExtensions, func(o asn1.ObjectIdentifier) bool {
		return o.Equal(cryptoutils.SANOID)
	})
	_, err := leaf.Verify(x509.VerifyOptions{
		Intermediates: intermediates,
		Roots:         f.Roots,
		CurrentTime:   at,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageCodeSigning},
	})
	if err != nil {
		return chainError(err, f.CAName)
	}
	issuer, err := oidcIssuer(leaf)
	if err != nil {
		return err
	}
	if issuer != f.OIDCIssuer {
		return fmt.Errorf("OIDC issuer %s, want %s", issuer, f.OIDCIssuer)
	}
	if !slices.Contains(leaf.EmailAddresses, f.SubjectEmail) {
		got := strings.Join(leaf.EmailAddresses, ", ")
		if got == "" {
			got = "none"
		}
		return fmt.Errorf("certificate email %s, want %s", got, f.SubjectEmail)
	}
	return nil
}

// chainError says why a certificate does not verify with the CA.
func chainError(err error, ca string) error {
	var unknown x509.UnknownAuthorityError
	var invalid x509.CertificateInvalidError
	switch {
	case errors.As(err, &unknown):
		return fmt.Errorf("certificate not issued by the Fulcio CA %s", ca)
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return fmt.Errorf("certificate chain not valid when Rekor logged the signature: %v", err)
	case errors.As(err, &invalid) && invalid.Reason == x509.IncompatibleUsage:
		return errors.New("certificate not for code signing")
	}
	return fmt.Errorf("certificate does not verify with the Fulcio CA %s: %v", ca, err)
}

// oidcIssuer is the OIDC issuer Fulcio recorded in cert, from either
// extension; both, if present, must agree.
func oidcIssuer(cert *x509.Certificate) (string, error) {
	var v1, v2 string
	var has1, has2 bool
	for _, ext := range cert.Extensions {
		switch {
		case ext.Id.Equal(oidIssuerV1):
			v1, has1 = string(ext.Value), true
		case ext.Id.Equal(oidIssuerV2):
			rest, err := asn1.Unmarshal(ext.Value, &v2)
			if err != nil || len(rest) != 0 {
				return "", errors.New("bad certificate: its OIDC issuer (v2) extension is not a DER string")
			}
			has2 = true
		}
	}
	switch {
	case has1 && has2 && v1 != v2:
		return "", fmt.Errorf("bad certificate: OIDC issuer extensions disagree: v1 %q, v2 %q", v1, v2)
	case has2:
		return v2, nil
	case has1:
		return v1, nil
	}
	return "", errors.New("certificate names no OIDC issuer: not issued by Fulcio")
}
